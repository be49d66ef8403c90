"""Decode step time of the sharded engine step at a real model shape, with random weights made on device.

    python -m tools.bench_sharded --preset gpt-oss-120b --model-parallel 2 --mode low_latency --batch 1,64
    python -m tools.bench_sharded --preset gpt-oss-120b --model-parallel 4 --mode max_throughput --batch 1,64 \
        --dispatch both
    python -m tools.bench_sharded --smoke          # CPU: 8 simulated devices, tiny shape, both modes

Every parameter is generated directly in its sharded placement and in the layout `--impl` reads (the Pallas
kernels' expert encoding for `pallas`), so no host copy, checkpoint or conversion is needed
(`tools.common.random_params`). `--batch` is sequences per attention rank (a replica group in low_latency, one
device in max_throughput); every sequence sits at position `--context - 1` with its own pages and a token no
other row has (identical rows would all route to the same experts: a too-cheap MoE). `--dispatch`
(max_throughput; low latency has no tokens to dispatch and runs once) picks how tokens reach their experts'
devices: `all_gather` + reduce-scatter, `all_to_all` (ragged), or both. Prints the median step time of
`steps.decode` (one token per sequence, greedy sampling included) and tokens/s in total, per device and per
user, and writes JSON with `--json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from gptoss_jax import config as config_lib
from gptoss_jax import random_weights, runtime
from pallas_kernels import KernelConfig
from sharding.rules import make_layout
from tools.common import decode_step, random_params, resolved

SMOKE_DEVICES = 8


def bench(cfg, layout, params, kernels: KernelConfig, rows_per_rank: int, context: int, iters: int) -> dict:
    step = decode_step(params, cfg, rows_per_rank, context - 1, kernels, layout=layout, num_top=1)
    t0 = time.perf_counter()
    step()
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    step.free()
    t = statistics.median(times)
    B, n = layout.num_ranks * rows_per_rank, layout.mesh.devices.size
    return dict(
        mode=layout.mode,
        dispatch=layout.dispatch,
        impl=kernels.impl,
        devices=n,
        batch_per_rank=rows_per_rank,
        global_batch=B,
        step_ms=t * 1e3,
        tok_s=B / t,
        tok_s_per_device=B / t / n,
        tok_s_per_user=1 / t,
        first_call_s=compile_s,
    )


def main():
    runtime.prepare()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt-oss-120b")
    ap.add_argument("--model-parallel", type=int, default=None, help="default: all devices (1 replica)")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--mode", choices=("low_latency", "max_throughput", "both"), default="both")
    ap.add_argument(
        "--impl",
        choices=("pallas", "reference"),
        default="pallas",
        help="kernels (interpreted off-GPU: slow) or the pure-JAX reference",
    )
    ap.add_argument("--dispatch", choices=("all_gather", "all_to_all", "both"), default="all_gather")
    ap.add_argument("--batch", default="1,64", help="decode sequences per attention rank, comma-separated")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (time scales per layer)")
    ap.add_argument("--smoke", action="store_true", help=f"CPU check: {SMOKE_DEVICES} simulated devices, tiny model")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.smoke:  # before anything touches a device
        if not jax.config.jax_platforms:
            jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", SMOKE_DEVICES)
        raw = dict(random_weights.DEMO_CONFIG, vocab_size=512, num_hidden_layers=4, num_local_experts=4)
        cfg, dtype = config_lib.from_hf_dict(raw), jnp.float32
        devices, iters = SMOKE_DEVICES, 2
    else:
        cfg, dtype = config_lib.preset(args.preset), jnp.bfloat16
        devices, iters = jax.device_count(), args.iters
    if args.layers:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    kernels = resolved(KernelConfig(impl=args.impl))
    model_parallel = args.model_parallel or devices // args.replicas
    modes = ("low_latency", "max_throughput") if args.mode == "both" else (args.mode,)
    dispatches = ("all_gather", "all_to_all") if args.dispatch == "both" else (args.dispatch,)
    results = []
    print(
        f"{args.preset if not args.smoke else 'smoke'}: {jax.device_count()} x {jax.devices()[0].device_kind}, "
        f"mesh {args.replicas} replicas x {model_parallel} model, context {args.context}, impl {args.impl}",
        flush=True,
    )
    for mode in modes:
        layout = make_layout(model_parallel, args.replicas, mode)
        t0 = time.perf_counter()
        params = random_params(cfg, kernels, dtype, layout)
        jax.block_until_ready(params)
        print(f"  {mode}: random weights on device in {time.perf_counter() - t0:.1f} s", flush=True)
        # low latency: tokens are replicated over `model` after attention, nothing to dispatch
        for dispatch in dispatches if mode == "max_throughput" else dispatches[:1]:
            layout = dataclasses.replace(layout, dispatch=dispatch)
            for b in (int(x) for x in args.batch.split(",")):
                r = bench(cfg, layout, params, kernels, b, args.context, iters)
                results.append(r)
                print(
                    f"  {mode:15s} {dispatch:10s} batch/rank {b:3d} (global {r['global_batch']:4d}): "
                    f"step {r['step_ms']:8.2f} ms, {r['tok_s']:9.1f} tok/s, {r['tok_s_per_device']:8.1f} tok/s "
                    f"per device, {r['tok_s_per_user']:6.1f} tok/s per user",
                    flush=True,
                )
        del params
    if args.json:
        Path(args.json).write_text(
            json.dumps(dict(args=vars(args), device=str(jax.devices()[0].device_kind), results=results), indent=1)
        )


if __name__ == "__main__":
    main()
