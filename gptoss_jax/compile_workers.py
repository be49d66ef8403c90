"""A cold start's steps compiled in worker processes, side by side.

Tracing and lowering a step holds the interpreter: 1-3 s per program for gpt-oss on an H200, most of it the Mosaic
GPU kernels lowered in Python, so one process lowers the ~56 programs of a 131,072-token max_throughput grid one after
another (112 s) however many threads compile them (docs/BENCHMARKS.md §11). Worker processes each lower and compile
a share of the programs from their argument shapes alone (no weights: on the device only XLA's autotuning scratch,
in the room the engine's memory pool has not grown into yet) and leave the executables in the program store, from
which the engine loads them. A worker that fails costs only time: whatever it did not store, the engine compiles
itself.

Run as `python -m gptoss_jax.compile_workers PLAN` by `compile_all`, never by hand. Single-device engines only (a
mesh's placements would have to be rebuilt in the worker).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)
MAX_WORKERS = 8
# Device memory a worker may take: its CUDA context and XLA's autotuning, which runs a program's largest operands
# (the 1.1 GiB unembedding of gpt-oss among them), beside the engine's weights and KV cache, before its
# activations have grown its memory pool to `gpu_memory_utilization`.
WORKER_BYTES = 3 << 30


@dataclasses.dataclass(frozen=True)
class Job:
    """One program: the store `key` the engine decided, the `steps` function, and its arguments as shapes."""

    key: str
    step: str  # "decode" | "prefill"
    args: Any  # (params, cache, batch) with `jax.ShapeDtypeStruct` leaves, unplaced
    label: str


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one worker compiles: `jobs` under the step settings `st`, stored in `folder`'s program store."""

    st: Any  # steps.StepConfig (None: the steps take no settings)
    folder: str
    jobs: tuple[Job, ...]
    threads: int


def default_workers(platform: str, programs: int, free_bytes: int | None) -> int:
    """Half the cores (the other half compiles inside them), at most `MAX_WORKERS` and as many as `free_bytes` of
    device memory hold, on a GPU; none on a CPU, where XLA's compilation already takes the cores and the programs
    lower quickly."""
    if platform != "gpu":
        return 0
    room = MAX_WORKERS if free_bytes is None else free_bytes // WORKER_BYTES
    return max(0, min(MAX_WORKERS, (os.cpu_count() or 1) // 2, programs, room))


def abstract(tree: Any) -> Any:
    """`tree`'s arrays as unplaced shapes (picklable; the worker places them on its first device)."""
    import jax

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type), tree)


def compile_all(st: Any, folder: Path, jobs: list[Job], workers: int, report: Callable[[str], None]) -> dict[str, str]:
    """Compile `jobs` in `workers` processes into `folder`'s program store; `report(key)` as each is stored.
    Returns {key: why} for the jobs no worker stored (a failed worker's, say), which the caller compiles itself."""
    shares = [jobs[i::workers] for i in range(workers)]
    cores = os.cpu_count() or 1
    threads = max(1, cores // workers)
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)  # the engine's pool fraction is not the worker's
    lock, failed = threading.Lock(), {}
    labels = {j.key: j.label for j in jobs}

    def watch(proc: subprocess.Popen, share: list[Job], err_path: Path) -> None:
        stored = set()
        for line in proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("stored"):
                stored.add(msg["key"])
                report(msg["key"])
            elif "error" in msg:
                with lock:
                    failed[msg["key"]] = msg["error"]
        rc = proc.wait()
        if rc != 0:
            tail = err_path.read_text(errors="replace")[-2000:] if err_path.exists() else ""
            log.warning("compile worker exited with status %d; the engine compiles its programs itself:\n%s", rc, tail)
        with lock:
            for job in share:
                if job.key not in stored and job.key not in failed:
                    failed[job.key] = f"worker exited with status {rc}"

    with tempfile.TemporaryDirectory(prefix="gptoss-compile-") as tmp:
        watchers = []
        for i, share in enumerate(s for s in shares if s):
            plan_path, err_path = Path(tmp) / f"plan{i}.pkl", Path(tmp) / f"worker{i}.err"
            plan_path.write_bytes(pickle.dumps(Plan(st, str(folder), tuple(share), threads)))
            with open(err_path, "wb") as err:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "gptoss_jax.compile_workers", str(plan_path)],
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                    env=env,
                )
            t = threading.Thread(target=watch, args=(proc, share, err_path), daemon=True)
            t.start()
            watchers.append(t)
        for t in watchers:
            t.join()
    for key, why in failed.items():
        log.warning("compile worker did not store %s (%s); compiling it here", labels[key], why)
    return failed


def _work(plan: Plan) -> None:
    """Lower the plan's programs one after another, compile them on `plan.threads` threads, store each, and say so
    on stdout (one JSON line per program)."""
    import jax

    from gptoss_jax import steps
    from gptoss_jax.program_store import ProgramStore

    # The programs go to the store; XLA's own cache would only write each a second time, under its lock.
    jax.config.update("jax_enable_compilation_cache", False)
    store = ProgramStore(Path(plan.folder))
    place = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    out = threading.Lock()

    def say(**msg):
        with out:
            print(json.dumps(msg), flush=True)

    def compile_one(job: Job, lowered, t0: float) -> None:
        try:
            if not store.save(job.key, lowered.compile()):
                raise OSError(f"not stored in {store.folder} (see the warning above)")
            say(key=job.key, stored=True, seconds=time.perf_counter() - t0)
        except Exception as e:  # reported; the engine compiles this one itself
            say(key=job.key, error=f"{type(e).__name__}: {e}"[:500])

    with concurrent.futures.ThreadPoolExecutor(plan.threads) as pool:
        for job in plan.jobs:
            t0 = time.perf_counter()
            try:
                args = jax.tree.map(
                    lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, weak_type=s.weak_type, sharding=place), job.args
                )
                lowered = getattr(steps, job.step).lower(*args, **({} if plan.st is None else {"st": plan.st}))
            except Exception as e:
                say(key=job.key, error=f"{type(e).__name__}: {e}"[:500])
                continue
            pool.submit(compile_one, job, lowered, t0)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    _work(pickle.loads(Path(sys.argv[1]).read_bytes()))
