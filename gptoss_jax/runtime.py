"""Process settings a serving process applies before it touches a device (`Engine`, `LLM` and `serve` call
`prepare`); importing the package changes none of them."""

import logging
import os

from jax._src import xla_bridge

log = logging.getLogger(__name__)

# JAX preallocates 75% of GPU memory unless told otherwise; the KV cache is sized from what that pool leaves after
# the weights, and on one H200 75% starves gpt-oss-120b (91 preemptions in the 1k/1k job, docs/BENCHMARKS.md §4b).
# An engine wants nearly all of it, as vLLM's gpu_memory_utilization=0.9 does. An explicit value wins.
GPU_MEMORY_FRACTION = "0.92"


def prepare() -> None:
    """Give the engine `GPU_MEMORY_FRACTION` of GPU memory unless `XLA_PYTHON_CLIENT_MEM_FRACTION` is set. JAX reads
    the variable when its GPU backend starts, so a process that used a device before keeps what it had (logged)."""
    if "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ:
        return
    if xla_bridge.backends_are_initialized():
        log.info(
            "JAX's backends started before gptoss_jax.runtime.prepare(): the GPU memory pool keeps JAX's default "
            "size; set XLA_PYTHON_CLIENT_MEM_FRACTION=%s before the first JAX call for the engine's",
            GPU_MEMORY_FRACTION,
        )
        return
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = GPU_MEMORY_FRACTION
