"""The engine's steps traced and lowered in worker processes, so that a cold start lowers its programs in parallel.

Tracing and lowering a step is Python that holds the interpreter: 1-4 s a program on an H200's host (most of it the
Mosaic GPU kernels' lowering), one program after another, while XLA's compilation of the earlier ones runs on
threads (docs/BENCHMARKS.md §11, §14). Here each worker is a JAX process without a GPU: it traces a step from its
arguments' shapes and lowers it for the engine's platform with `jax.export` (the kernels are lowered for the device
the `KernelConfig` names, not interpreted for the worker's own: `pallas_kernels._choose`). The engine's process
lowers a call of that module (milliseconds: nothing is traced again) and compiles it on its own threads, in its own
CUDA context, so XLA's autotuning uses the engine's device memory as before and nothing else touches the GPU.

Each worker is a fresh interpreter (`python -m gptoss_jax.lowering`, jobs and modules pickled over its pipes), not a
`multiprocessing` child: those import the user's main script again, and a script without an `if __name__ ==
"__main__"` guard would then load its model once per worker. A program the workers cannot lower (a worker fails or
dies, a step setting that cannot be pickled) is lowered in the engine's process as before, with a warning: workers
can make a start faster, never make it fail.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import pickle
import queue
import subprocess
import sys
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
    """`count` lowering processes, started at once (each imports JAX while the engine does other work), and a
    thread each that hands it jobs."""

    def __init__(self, count: int):
        device = jax.devices()[0]
        self._device = (export.default_export_platform(), device.device_kind, getattr(device, "core_count", None))
        settings = {name: getattr(jax.config, name) for name in program_store.JAX_SETTINGS}
        # CPU only, and the engine's import path (it may have been extended at run time)
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self._idle: queue.Queue[subprocess.Popen] = queue.Queue()
        self._procs = []
        for _ in range(count):
            proc = subprocess.Popen(
                [sys.executable, "-m", "gptoss_jax.lowering"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
            )
            pickle.dump(settings, proc.stdin)
            proc.stdin.flush()
            self._procs.append(proc)
            self._idle.put(proc)
        self._threads = concurrent.futures.ThreadPoolExecutor(count, thread_name_prefix="lowering")

    def submit(self, step, st: steps.StepConfig, args: tuple) -> concurrent.futures.Future:
        """Lower `step` (a jitted function of `gptoss_jax.steps`) with static settings `st` for `args` (arrays or
        shapes) in a worker -> a future of the serialized module."""
        job = pickle.dumps((step.__name__, st, abstract(args), self._device))
        return self._threads.submit(self._run, job)

    def _run(self, job: bytes) -> bytes:
        proc = self._idle.get()
        try:
            proc.stdin.write(job)
            proc.stdin.flush()
            ok, result = pickle.load(proc.stdout)
        except Exception:
            proc.kill()  # a broken pipe or a dead worker: it takes no more jobs
            raise RuntimeError(f"lowering worker {proc.pid} died (exit code {proc.poll()})") from None
        self._idle.put(proc)
        if not ok:
            raise RuntimeError(result)
        return result

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        for proc in self._procs:
            with contextlib.suppress(OSError):
                proc.stdin.close()  # end of jobs: the worker exits
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()


def lowered(blob: bytes, args: tuple) -> jax.stages.Lowered:
    """The engine-side `Lowered` of a worker's module, for the real `args` (placed on the engine's device)."""
    exported = pickle.loads(blob)
    return jax.jit(exported.call, donate_argnums=_DONATED).trace(*args).lower()


def _lower(name: str, st: steps.StepConfig, args: tuple, device: tuple[str, str, int | None]) -> bytes:
    """The serialized `jax.export` of step `name` for `device` = (platform, device kind, cores): a GPU is named to
    the kernels' lowering (Triton reads its compute capability from the kind) by an abstract one-device mesh."""
    platform, kind, cores = device
    checks = [export.DisabledSafetyCheck.custom_call(target) for target in _CUSTOM_CALLS]
    target = contextlib.nullcontext()
    if platform in ("cuda", "rocm"):
        gpu = jax.sharding.AbstractDevice(kind, cores, "gpu")
        mesh = jax.sharding.AbstractMesh((1,), ("device",), (jax.sharding.AxisType.Auto,), abstract_device=gpu)
        target = jax.sharding.use_abstract_mesh(mesh)
    with target:
        exported = export.export(getattr(steps, name), platforms=(platform,), disabled_checks=checks)(*args, st=st)
    return pickle.dumps(dataclasses.replace(exported, _get_vjp=None))  # (a closure: rebuilt on the engine's side)


def _serve() -> None:
    """A worker: the engine's JAX settings, then jobs until its input ends, each answered with (True, module) or
    (False, the error). The answers go to the original stdout; anything else printed goes to stderr."""
    jax.config.update("jax_platforms", "cpu")
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    jobs = sys.stdin.buffer
    for name, value in pickle.load(jobs).items():
        jax.config.update(name, value)
    while True:
        try:
            job = pickle.load(jobs)
        except EOFError:
            return
        try:
            answer = (True, _lower(*job))
        except Exception as e:  # noqa: BLE001 - the engine lowers this one itself
            answer = (False, f"{type(e).__name__}: {e}")
        pickle.dump(answer, answers)
        answers.flush()


if __name__ == "__main__":
    _serve()
