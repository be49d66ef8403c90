"""Does dispatching an engine step block the host? For each step shape and kernel variant: the host's time in the
call (returning the step's output arrays, not waiting for them) with the device idle, and with the device busy
behind a queue of matmuls. A call that only enqueues work returns in about the same time either way; one that
waits for the device inside the call (a synchronous copy, a stream synchronization) takes the queue's length too,
and then the engine's host cannot schedule the next step while the device runs this one.

    python -m tools.probe_dispatch --preset gpt-oss-20b --variant default: --variant triton:mosaic=false
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels import KernelConfig
from tools.common import decode_step, model_config, parse_variants, prefill_step, random_params, resolved


def busy_queue(ms: float):
    """A function that enqueues about `ms` of device work (bf16 matmuls) and returns at once."""
    x = jnp.ones((4096, 4096), jnp.bfloat16)
    one = jax.jit(lambda a: (a @ a) * 1e-3)
    jax.block_until_ready(one(x))
    t0 = time.perf_counter()
    jax.block_until_ready(one(x))
    n = max(1, round(ms / (1e3 * (time.perf_counter() - t0))))
    return lambda: [one(x) for _ in range(n)][-1]


def probe(step, busy, reps: int) -> dict:
    """Median host seconds per call, device idle and device busy; and the step's own device time."""
    jax.block_until_ready(step(block=False))
    idle, loaded, total = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = step(block=False)
        idle.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
        total.append(time.perf_counter() - t0)
        queue = busy()
        t0 = time.perf_counter()
        out = step(block=False)
        loaded.append(time.perf_counter() - t0)
        jax.block_until_ready((queue, out))
    return {
        "call_idle_ms": 1e3 * statistics.median(idle),
        "call_busy_ms": 1e3 * statistics.median(loaded),
        "step_ms": 1e3 * statistics.median(total),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-oss-20b")
    ap.add_argument("--variant", action="append", default=[], help="NAME:field=value,... (KernelConfig fields)")
    ap.add_argument("--prefill", default="1x128,4x128,16x1024", help="ROWSxTOKENS prefill shapes")
    ap.add_argument("--decode", default="64x1024", help="ROWSxCONTEXT decode shapes (2 steps a call)")
    ap.add_argument("--busy-ms", type=float, default=50.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = model_config(args.preset)
    variants = parse_variants(ap, args.variant or ["default:"], KernelConfig())
    busy = busy_queue(args.busy_ms)
    rows = []
    params = None
    for name, kernels in variants:
        kernels = resolved(kernels)
        if params is not None:
            jax.tree.map(lambda a: a.delete(), params)
        params = random_params(cfg, kernels)  # per variant: the experts' layout depends on the kernels
        shapes = [("prefill", *map(int, s.split("x"))) for s in args.prefill.split(",") if s]
        shapes += [("decode", *map(int, s.split("x"))) for s in args.decode.split(",") if s]
        for kind, a, b in shapes:
            if kind == "prefill":
                step = prefill_step(params, cfg, a, b, kernels)
            else:
                step = decode_step(params, cfg, a, b, kernels, num_steps=2)
            row = {"variant": name, "step": f"{kind} {a}x{b}", **probe(step, busy, args.reps)}
            step.free()
            rows.append(row)
            print(
                f"{name:10s} {row['step']:18s} call idle {row['call_idle_ms']:7.2f} ms  "
                f"busy {row['call_busy_ms']:7.2f} ms  (step {row['step_ms']:.2f} ms, queue {args.busy_ms:.0f} ms)",
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(json.dumps({"device": jax.devices()[0].device_kind, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
