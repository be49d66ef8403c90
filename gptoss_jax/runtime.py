"""Process settings a serving process applies before it touches a device (`Engine`, `LLM` and `serve` call
`prepare`); importing the package changes none of them.

- GPU memory: JAX's pool raised from 75% to `GPU_MEMORY_FRACTION` of the device (or to the engine's
  `gpu_memory_utilization` where that is higher; the engine itself keeps to `gpu_memory_utilization`).
- JAX's persistent compilation cache, on by default in `home()/compile-cache`, so a restart loads the compiled
  steps (the Pallas kernels inside them included) instead of compiling them again. It is per user (the folder is
  made private: a compilation cache is trusted code), bounded (`COMPILE_CACHE_BYTES`, least recently used entries
  evicted) and shared safely by concurrent processes (JAX locks the folder when it is bounded); a failed read or
  write is a warning, never a failed start.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax
from jax._src import xla_bridge
from jax.experimental.compilation_cache import compilation_cache

log = logging.getLogger(__name__)

# JAX preallocates 75% of GPU memory unless told otherwise; the KV cache is sized from what that pool leaves after
# the weights, and on one H200 75% starves gpt-oss-120b (91 preemptions in the 1k/1k job, docs/BENCHMARKS.md §4b).
# An engine wants nearly all of it, as vLLM's gpu_memory_utilization=0.9 does. An explicit value wins.
GPU_MEMORY_FRACTION = "0.92"
COMPILE_CACHE_BYTES = 32 << 30
OFF = ("", "0", "off", "none", "false")


def home() -> Path:
    """The per-user folder of gptoss-jax's files (the demo checkpoint, the compilation cache): `$GPTOSS_JAX_HOME`,
    default `~/.cache/gptoss_jax` (`$XDG_CACHE_HOME/gptoss_jax` where that is set)."""
    if "GPTOSS_JAX_HOME" in os.environ:
        return Path(os.environ["GPTOSS_JAX_HOME"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")).expanduser() / "gptoss_jax"


def compile_cache_dir(setting: str | os.PathLike | bool | None = None) -> Path | None:
    """Where compiled programs persist: `setting` (a folder; False or "off" for none), else
    `$GPTOSS_JAX_COMPILE_CACHE` (the same), else the folder JAX was given (`JAX_COMPILATION_CACHE_DIR`), else
    `home()/compile-cache`."""
    if setting is None:
        setting = os.environ.get("GPTOSS_JAX_COMPILE_CACHE") or jax.config.jax_compilation_cache_dir
    if setting is None or setting is True:
        return home() / "compile-cache"
    if setting is False or str(setting).strip().lower() in OFF:
        return None
    return Path(setting).expanduser()


def prepare(
    compile_cache: str | os.PathLike | bool | None = None, gpu_memory_utilization: float | None = None
) -> Path | None:
    """Apply the process settings (see the module docstring) for a process about to serve; returns the
    compilation cache folder in use (None: off). `compile_cache` as `compile_cache_dir`; a `gpu_memory_utilization`
    above `GPU_MEMORY_FRACTION` raises JAX's pool to it."""
    _memory_fraction(max(float(GPU_MEMORY_FRACTION), gpu_memory_utilization or 0.0))
    return _compile_cache(compile_cache_dir(compile_cache))


def device_memory_bytes(stats: dict) -> int:
    """The whole memory of a device, from its `memory_stats()`: JAX's pool (`bytes_limit`) is
    `XLA_PYTHON_CLIENT_MEM_FRACTION` of it (0.75 when unset); the platform allocator has no pool of its own."""
    if os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR") == "platform":
        return int(stats["bytes_limit"])
    return int(stats["bytes_limit"] / float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")))


def _memory_fraction(fraction: float) -> None:
    """JAX reads the variable when its GPU backend starts, so a process that used a device before keeps what it
    had (logged)."""
    if "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ:
        return
    if xla_bridge.backends_are_initialized():
        log.info(
            "JAX's backends started before gptoss_jax.runtime.prepare(): the GPU memory pool keeps JAX's default "
            "size; set XLA_PYTHON_CLIENT_MEM_FRACTION=%s before the first JAX call for the engine's",
            f"{fraction:g}",
        )
        return
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{fraction:g}"


def _compile_cache(path: Path | None) -> Path | None:
    current = jax.config.jax_compilation_cache_dir
    if path is None:
        if current is not None and jax.config.jax_enable_compilation_cache:  # an earlier engine turned it on
            compilation_cache.reset_cache()
            jax.config.update("jax_enable_compilation_cache", False)
        return None
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        log.warning("compilation cache off: cannot create %s (%s)", path, e)
        return None
    if current != str(path) or not jax.config.jax_enable_compilation_cache:
        # JAX decides once per process whether its cache is used (at the first compilation, which may have come
        # before this call): start it afresh with these settings.
        compilation_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", str(path))
        jax.config.update("jax_enable_compilation_cache", True)
        # Every program, however small or quick: a warm restart should compile nothing at all.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        jax.config.update("jax_compilation_cache_max_size", COMPILE_CACHE_BYTES)
        log.info("compilation cache: %s", path)
    return path
