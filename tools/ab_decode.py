"""A/B timing of the compiled decode step: the kernel settings as shipped against variants of them.

Each variant replaces fields of the engine's `KernelConfig` (Python literals; `true`, `false`, `null` as in a
config file), and runs on the same random weights as the baseline, in one process, so the difference is the
code path and not the machine:

    python -m tools.ab_decode --presets gpt-oss-20b --batches 1,4,16 --variant unfused_route:moe_route_max_tokens=0

All variants are compiled first, then timed in turns (`--rounds` times through the list), so that a drift of
the GPU's clock or temperature during the run reaches every variant alike: one variant timed after another
differed by up to 4% between two identical runs. Prints TPOT per variant and batch (median over the rounds),
the ratio to the first variant, and the copy bandwidth of the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import jax

import pallas_kernels
from gptoss_jax import runtime
from pallas_kernels import KernelConfig
from tools.common import copy_bandwidth, decode_step, model_config, parse_variants, random_params, resolved, timeit


def main() -> None:
    runtime.prepare()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="gpt-oss-20b", help="preset names or HF config.json paths")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5, help="timed calls per variant and round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument(
        "--variant", action="append", default=[], help="NAME:field=value[,...]: KernelConfig fields (repeatable)"
    )
    ap.add_argument("--out", default="ab_decode.json")
    args = ap.parse_args()
    base = KernelConfig(impl="pallas")
    variants = [(name, resolved(k)) for name, k in [("tree", base)] + parse_variants(ap, args.variant, base)]
    bw = copy_bandwidth(warmup=1)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for preset in args.presets.split(","):
        cfg = model_config(preset)
        params = random_params(cfg, variants[0][1])
        # with what else each variant's kernels store (the Mosaic kernels' scale operands)
        prepared = [pallas_kernels.prepare_params(params, k) for _, k in variants]
        for batch in [int(b) for b in args.batches.split(",")]:
            calls = [
                decode_step(p, cfg, batch, args.context, k, num_steps=args.steps)
                for p, (_, k) in zip(prepared, variants)
            ]
            for step in calls:  # its first call compiles it
                step()
            times = [[] for _ in variants]
            for _ in range(args.rounds):
                for t, step in zip(times, calls):
                    t.append(timeit(step, warmup=1, reps=args.reps) / args.steps)
            base_tpot = statistics.median(times[0])
            for (name, _), t, step in zip(variants, times, calls):
                step.free()
                tpot = statistics.median(t)
                rows.append(
                    dict(
                        preset=preset,
                        variant=name,
                        batch=batch,
                        context=args.context,
                        tpot_ms=tpot * 1e3,
                        rounds_ms=[v * 1e3 for v in t],
                    )
                )
                print(
                    f"{preset} B={batch:3d} {name:16s} TPOT {tpot * 1e3:7.3f} ms  {1 / tpot:7.1f} tok/s/user  "
                    f"x{base_tpot / tpot:.3f} vs {variants[0][0]}  (rounds {min(t) * 1e3:.3f}-{max(t) * 1e3:.3f})",
                    flush=True,
                )
        del params, prepared
    Path(args.out).write_text(
        json.dumps(
            dict(device=jax.devices()[0].device_kind, copy_TBps=bw / 1e12, variants=args.variant, rows=rows), indent=1
        )
    )


if __name__ == "__main__":
    main()
