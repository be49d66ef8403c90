"""Compiled engine steps kept on disk across processes, so a restart neither traces nor compiles them.

JAX's persistent compilation cache (`runtime`) skips XLA's compilation, but finding an entry needs the lowered
program, and tracing and lowering a gpt-oss step takes 1-4 s (H200, 20b): at ~50 programs that alone is minutes.
This store keys each compiled step by what decides it, without tracing: the source of the three packages, the
JAX version, the devices, the step's static settings (`steps.StepConfig`) and the shapes, dtypes and placements of
its arguments; and keeps the serialized executable (`jax.experimental.serialize_executable`) under that key.

The folder is the compilation cache's (`runtime.compile_cache_dir`), so it is private to the user: a serialized
executable is trusted code. Writes go to a temporary file renamed into place, so concurrent processes never read
half an entry; a failed read or write is a warning, and the step is compiled as if nothing were stored.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
import threading
from pathlib import Path
from typing import Any

import jax
from jax import monitoring
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)
PACKAGES = ("gptoss_jax", "pallas_kernels", "sharding")
STORE_BYTES = 8 << 30  # least recently used entries go past this (an edit of the code makes new keys)
# JAX settings that change what a traced step compiles to (the code itself is in the source fingerprint).
JAX_SETTINGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_threefry_partitionable", "jax_default_prng_impl")


@functools.cache
def source_fingerprint() -> str:
    """A hash of every Python file of the three packages: any code change makes new keys."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _describe(x: Any) -> str:
    """What of an argument leaf decides the program: shape, dtype, and placement when committed."""
    placement = repr(x.sharding) if getattr(x, "committed", True) else "uncommitted"
    return f"{tuple(x.shape)}:{x.dtype}:{placement}"


_thread = threading.local()  # this thread's count of XLA persistent-cache hits


def _count_hit(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _thread.hits = getattr(_thread, "hits", 0) + 1


@functools.cache
def _listen() -> None:
    monitoring.register_event_listener(_count_hit)


class ProgramStore:
    """Serialized compiled steps in `folder/programs` (no folder: a store that keeps nothing)."""

    def __init__(self, folder: Path | None):
        self.folder = folder / "programs" if folder is not None else None

    def key(self, name: str, static: Any, args: tuple) -> str | None:
        """The key of step `name` compiled with static settings `static` for `args` (None without a folder)."""
        if self.folder is None:
            return None
        h = hashlib.sha256()
        devices = [(d.id, d.platform, d.device_kind, str(getattr(d, "compute_capability", ""))) for d in jax.devices()]
        settings = [(s, str(getattr(jax.config, s, None))) for s in JAX_SETTINGS]
        for part in (
            source_fingerprint(),
            jax.__version__,
            jax.lib.__version__,
            devices,
            settings,
            os.environ.get("XLA_FLAGS", ""),
            name,
            repr(static),
        ):
            h.update(repr(part).encode())
        leaves, tree = jax.tree.flatten(args)
        h.update(repr(tree).encode())
        for leaf in leaves:
            h.update(_describe(leaf).encode())
        return h.hexdigest()

    def load(self, key: str | None, devices):
        """The stored step for `key`, loaded onto `devices` (those it was compiled for), or None."""
        if key is None:
            return None
        path = self.folder / f"{key}.pkl"
        if not path.exists():
            return None
        try:
            serialized, in_tree, out_tree = pickle.loads(path.read_bytes())
            os.utime(path)  # recently used: the last to be evicted
            return serialize_executable.deserialize_and_load(
                serialized, in_tree, out_tree, execution_devices=list(devices)
            )
        except Exception as e:  # a stale or broken entry: compile instead
            log.warning("compiled step %s could not be loaded (%s: %s); compiling it", path.name, type(e).__name__, e)
            return None

    def compile(self, lowered, key: str | None):
        """`lowered.compile()`, stored under `key` when XLA really compiled it: an executable that XLA's persistent
        cache loaded cannot be serialized again whole (on the CPU it loses its functions: jaxlib 0.11.2)."""
        _listen()
        hits = getattr(_thread, "hits", 0)
        compiled = lowered.compile()
        if getattr(_thread, "hits", 0) == hits:
            self.save(key, compiled)
        return compiled

    def save(self, key: str | None, compiled) -> None:
        if key is None:
            return
        try:
            data = pickle.dumps(serialize_executable.serialize(compiled))
            self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, self.folder / f"{key}.pkl")
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            self._evict()
        except Exception as e:  # a full disk, say: the step still runs, the next start compiles it again
            log.warning("compiled step not stored in %s (%s: %s)", self.folder, type(e).__name__, e)

    def _evict(self) -> None:
        """Remove the least recently used entries past `STORE_BYTES` (another process may remove one first)."""
        entries = []
        for path in self.folder.glob("*.pkl"):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime, st.st_size, path))
        entries.sort(reverse=True)
        total = 0
        for _, size, path in entries:
            total += size
            if total > STORE_BYTES:
                path.unlink(missing_ok=True)
