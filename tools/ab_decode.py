"""A/B timing of the compiled decode step: the tree as it is against variants that override module constants.

Each variant sets `module.NAME=value` pairs (Python literals) while its step is traced and compiled, on the same
random weights as the baseline, in one process, so the difference is the code path and not the machine:

    python tools/ab_decode.py --presets gpt-oss-20b --batches 1,4,16 \\
        --variant unfused_route:pallas_kernels.moe_route.MAX_TOKENS=0

All variants are compiled first, then timed in turns (`--rounds` times through the list), so that a drift of
the GPU's clock or temperature during the run reaches every variant alike: one variant timed after another
differed by up to 4% between two identical runs. Prints TPOT per variant and batch (median over the rounds),
the ratio to the first variant, and the copy bandwidth of the same run.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402

from bench_decode import copy_bandwidth, decode_call, model_config  # noqa: E402
from bench_reference import timeit  # noqa: E402
from gptoss_jax.random_weights import random_params  # noqa: E402


def parse_variant(spec: str) -> tuple[str, list[tuple[object, str, object]]]:
    """`name:mod.attr=value,mod.attr=value` -> (name, [(module, attr, value)])."""
    name, _, sets = spec.partition(":")
    out = []
    for item in filter(None, sets.split(",")):
        target, _, value = item.partition("=")
        mod, _, attr = target.rpartition(".")
        module = importlib.import_module(mod)
        if not hasattr(module, attr):
            raise SystemExit(f"--variant {spec!r}: {mod} has no attribute {attr!r}")
        out.append((module, attr, ast.literal_eval(value)))
    return name, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="gpt-oss-20b", help="preset names or HF config.json paths")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5, help="timed calls per variant and round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--variant", action="append", default=[], help="name:module.ATTR=value[,...] (repeatable)")
    ap.add_argument("--out", default="ab_decode.json")
    args = ap.parse_args()
    variants = [("tree", [])] + [parse_variant(v) for v in args.variant]
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for preset in args.presets.split(","):
        cfg = model_config(preset)
        params = random_params(cfg, impl="pallas")
        for batch in [int(b) for b in args.batches.split(",")]:
            calls = []
            for name, sets in variants:
                saved = [(m, a, getattr(m, a)) for m, a, _ in sets]
                for m, a, v in sets:
                    setattr(m, a, v)
                jax.clear_caches()  # the override must reach a fresh trace
                try:
                    calls.append(decode_call(params, cfg, batch, args.context, "pallas", args.steps, ahead=True))
                finally:
                    for m, a, v in saved:
                        setattr(m, a, v)
            times = [[] for _ in variants]
            for _ in range(args.rounds):
                for t, (run, _) in zip(times, calls):
                    t.append(timeit(run, warmup=1, reps=args.reps) / args.steps)
            base = statistics.median(times[0])
            for (name, _), t, (_, free) in zip(variants, times, calls):
                free()
                tpot = statistics.median(t)
                rows.append(dict(preset=preset, variant=name, batch=batch, context=args.context, tpot_ms=tpot * 1e3,
                                 rounds_ms=[v * 1e3 for v in t]))
                print(f"{preset} B={batch:3d} {name:16s} TPOT {tpot * 1e3:7.3f} ms  {1 / tpot:7.1f} tok/s/user  "
                      f"x{base / tpot:.3f} vs {variants[0][0]}  (rounds {min(t) * 1e3:.3f}-{max(t) * 1e3:.3f})",
                      flush=True)
        del params
    Path(args.out).write_text(json.dumps(dict(device=jax.devices()[0].device_kind, copy_TBps=bw / 1e12,
                                              variants=args.variant, rows=rows), indent=1))


if __name__ == "__main__":
    main()
