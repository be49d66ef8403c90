"""The engine's steps traced and lowered in worker processes, so that a cold start lowers its programs in parallel.

Tracing and lowering a step is Python that holds the interpreter: 1-4 s a program on an H200's host (most of it the
Mosaic GPU kernels' lowering), one program after another, while XLA's compilation of the earlier ones runs on
threads (docs/BENCHMARKS.md §11, §14). Here each worker is a JAX process without a GPU: it traces a step from its
arguments' shapes and lowers it for the engine's platform with `jax.export` (the kernels are lowered for the device
the `KernelConfig` names, not interpreted for the worker's own: `pallas_kernels._choose`). The engine's process
lowers a call of that module (milliseconds: nothing is traced again) and compiles it on its own threads, in its own
CUDA context, so XLA's autotuning uses the engine's device memory as before and nothing else touches the GPU.

A program the workers cannot lower (a worker fails or dies, a step setting that cannot be pickled) is lowered in
the engine's process as before, with a warning: workers can make a start faster, never make it fail.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import pickle
from typing import Any

import jax
from jax import export

from gptoss_jax import program_store, steps

log = logging.getLogger(__name__)

# Kernels whose serialized form jax does not promise to keep stable across versions. The module goes straight from
# the worker to the engine's process, run by the same jax, so stability across versions is not needed.
_CUSTOM_CALLS = ("__gpu$xla.gpu.triton", "mosaic_gpu", "triton_kernel_call")
_DONATED = (1, 2)  # every step's (params, cache, state, batch): the cache and the state are donated


def default_workers(platform: str, programs: int) -> int:
    """Workers worth starting: on a GPU, one per two cores up to 8 (the other cores compile), when there is more
    than a program or two to lower; none elsewhere (a CPU's own compiling needs its cores)."""
    if platform != "gpu" or programs < 3:
        return 0
    return max(0, min(8, (os.cpu_count() or 1) // 2, programs))


def abstract(tree: Any) -> Any:
    """Every leaf as a `jax.ShapeDtypeStruct` without placement (one device), weak types kept, so the worker traces
    the program the engine would."""

    def leaf(x):
        aval = jax.typeof(x)
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)

    return jax.tree.map(leaf, tree)


class Workers:
    """A pool of lowering processes (started at once: they import JAX while the engine does other work)."""

    def __init__(self, count: int):
        settings = {name: getattr(jax.config, name) for name in program_store.JAX_SETTINGS}
        device = jax.devices()[0]
        self.platform = export.default_export_platform()
        self._device = (self.platform, device.device_kind, getattr(device, "core_count", None))
        self._pool = concurrent.futures.ProcessPoolExecutor(
            count, mp_context=multiprocessing.get_context("spawn"), initializer=_start, initargs=(settings,)
        )
        self.count = count

    def submit(self, step, st: steps.StepConfig, args: tuple) -> concurrent.futures.Future:
        """Lower `step` (a jitted function of `gptoss_jax.steps`) with static settings `st` for `args` (arrays or
        shapes) in a worker -> a future of the serialized module."""
        return self._pool.submit(_lower, step.__name__, st, abstract(args), self._device)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def lowered(blob: bytes, args: tuple) -> jax.stages.Lowered:
    """The engine-side `Lowered` of a worker's module, for the real `args` (placed on the engine's device)."""
    exported = pickle.loads(blob)
    return jax.jit(exported.call, donate_argnums=_DONATED).trace(*args).lower()


def _start(settings: dict) -> None:
    """A worker's JAX: CPU only (it never touches the GPU), with the engine's settings that change a program."""
    jax.config.update("jax_platforms", "cpu")
    for name, value in settings.items():
        jax.config.update(name, value)


def _lower(name: str, st: steps.StepConfig, args: tuple, device: tuple[str, str, int | None]) -> bytes:
    """The serialized `jax.export` of step `name` for `device` = (platform, device kind, cores): a GPU is named to
    the kernels' lowering (Triton reads its compute capability from the kind) by an abstract one-device mesh."""
    platform, kind, cores = device
    checks = [export.DisabledSafetyCheck.custom_call(target) for target in _CUSTOM_CALLS]
    target = contextlib.nullcontext()
    if platform in ("cuda", "rocm"):
        mesh = jax.sharding.AbstractMesh(
            (1,),
            ("device",),
            (jax.sharding.AxisType.Auto,),
            abstract_device=jax.sharding.AbstractDevice(kind, cores, "gpu"),
        )
        target = jax.sharding.use_abstract_mesh(mesh)
    with target:
        exported = export.export(getattr(steps, name), platforms=(platform,), disabled_checks=checks)(*args, st=st)
    return pickle.dumps(dataclasses.replace(exported, _get_vjp=None))  # (a closure: rebuilt on the engine's side)
