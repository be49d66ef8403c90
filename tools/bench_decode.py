"""Decode benchmark: the engine's compiled decode step at batch x context points, against the roofline.

For each model, batch (1, 4, 16, 64, 256) and context (1k, 8k): random weights at the real shape
drawn on device, a KV cache with every row's context laid out in pages exactly as the engine lays
it out (synthetic tables, so no million-token prefill is needed), then `steps.decode` -- model,
sampling and cache writes, `--steps` tokens per call as the low-latency profile does -- timed.
Reports TPOT, output tok/s per user and per GPU, and the fraction of the memory roofline: the bytes
the step must read (weights once, distinct routed experts, unembedding, visible KV) over the copy
bandwidth measured in the same run. Host scheduling is not in these figures (tools.bench_throughput
measures the whole engine loop). `--reference` adds the pure-JAX path for the ratio.

    python -m tools.bench_decode --presets gpt-oss-20b,gpt-oss-120b --out $OUT/decode.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import jax

from gptoss_jax import runtime
from pallas_kernels import REFERENCE, KernelConfig
from pallas_kernels import params as params_lib
from tools.common import PAGE, copy_bandwidth, decode_bytes, decode_step, model_config, random_params, timeit


def main() -> None:
    runtime.prepare()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="gpt-oss-20b,gpt-oss-120b")
    ap.add_argument("--batches", default="1,4,16,64,256")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--steps", type=int, default=8, help="decode tokens per device call (multi-step)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--reference", default="1,64", help="batches also run on the reference path (first preset, first context)"
    )
    ap.add_argument("--memory-gib", type=float, default=None, help="device memory to plan with (default: read)")
    ap.add_argument("--out", default="decode.json")
    args = ap.parse_args()

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    bw = copy_bandwidth(warmup=1)
    result = {
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "commit": commit or "unknown",
        "copy_TBps": bw / 1e12,
        "steps_per_call": args.steps,
        "rows": [],
    }
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    limit = (
        args.memory_gib * 2**30 if args.memory_gib else (jax.devices()[0].memory_stats() or {}).get("bytes_limit", 0)
    )
    contexts = [int(c) for c in args.contexts.split(",")]
    ref_batches = {int(b) for b in args.reference.split(",") if b}
    kernels = {"pallas": KernelConfig(impl="pallas"), "reference": REFERENCE}
    for n, preset in enumerate(args.presets.split(",")):
        cfg = model_config(preset)
        with_reference = n == 0 and ref_batches
        # drawn in each path's expert layout, layer by layer
        params = {"pallas": random_params(cfg, kernels["pallas"])}
        if with_reference:
            params["reference"] = random_params(cfg, REFERENCE)
        weights = params_lib.nbytes(params["pallas"])
        for context in contexts:
            for batch in [int(b) for b in args.batches.split(",")]:
                kv = batch * (context + 2 * PAGE) * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2 / 2
                if limit and weights + kv > 0.9 * limit:
                    print(f"{preset} B={batch} ctx={context}: skipped ({(weights + kv) / 2**30:.0f} GiB > memory)")
                    continue
                on_reference = with_reference and batch in ref_batches and context == contexts[0]
                impls = ["pallas"] + (["reference"] if on_reference else [])
                for impl in impls:
                    step = decode_step(params[impl], cfg, batch, context, kernels[impl], num_steps=args.steps)
                    tpot = timeit(step, warmup=1, reps=args.reps) / args.steps
                    step.free()
                    need = decode_bytes(cfg, batch, context)
                    row = {
                        "preset": preset,
                        "impl": impl,
                        "batch": batch,
                        "context": context,
                        "tpot_ms": tpot * 1e3,
                        "tok_s_per_user": 1 / tpot,
                        "tok_s_per_gpu": batch / tpot,
                        "min_bytes": need,
                        "roofline_fraction": need / tpot / bw,
                    }
                    result["rows"].append(row)
                    print(
                        f"{preset} {impl:9s} B={batch:3d} ctx={context:5d}: TPOT {tpot * 1e3:7.2f} ms, "
                        f"{1 / tpot:7.1f} tok/s/user, {batch / tpot:8.0f} tok/s/GPU, "
                        f"{100 * row['roofline_fraction']:5.1f}% of roofline",
                        flush=True,
                    )
        del params
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
