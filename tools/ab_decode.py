"""A/B timing of the compiled decode step: the tree as it is against variants that override module constants.

Each variant sets `module.NAME=value` pairs (Python literals) before its steps are traced, on the same random
weights and caches as the baseline, in one process, so the difference is the code path and not the machine:

    python tools/ab_decode.py --presets gpt-oss-20b --batches 1,4,16 \\
        --variant unfused_route:pallas_kernels.moe_route.MAX_TOKENS=0

Prints TPOT per variant and batch, the ratio to the first variant, and the copy bandwidth of the same run.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402

from bench_decode import copy_bandwidth, time_decode  # noqa: E402
from gptoss_jax import config  # noqa: E402
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
    ap.add_argument("--presets", default="gpt-oss-20b")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--variant", action="append", default=[], help="name:module.ATTR=value[,...] (repeatable)")
    ap.add_argument("--out", default="ab_decode.json")
    args = ap.parse_args()
    variants = [("tree", [])] + [parse_variant(v) for v in args.variant]
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for preset in args.presets.split(","):
        cfg = config.preset(preset)
        params = random_params(cfg, impl="pallas")
        for batch in [int(b) for b in args.batches.split(",")]:
            base = None
            for name, sets in variants:
                saved = [(m, a, getattr(m, a)) for m, a, _ in sets]
                for m, a, v in sets:
                    setattr(m, a, v)
                jax.clear_caches()  # the override must reach a fresh trace
                try:
                    tpot = time_decode(params, cfg, batch, args.context, "pallas", args.steps, args.reps)
                finally:
                    for m, a, v in saved:
                        setattr(m, a, v)
                base = base or tpot
                rows.append(dict(preset=preset, variant=name, batch=batch, context=args.context, tpot_ms=tpot * 1e3))
                print(f"{preset} B={batch:3d} {name:16s} TPOT {tpot * 1e3:7.3f} ms  {1 / tpot:7.1f} tok/s/user  "
                      f"x{base / tpot:.3f} vs {variants[0][0]}", flush=True)
        del params
    Path(args.out).write_text(json.dumps(dict(device=jax.devices()[0].device_kind, copy_TBps=bw / 1e12,
                                              variants=args.variant, rows=rows), indent=1))


if __name__ == "__main__":
    main()
