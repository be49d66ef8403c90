"""Decode step time of the sharded engine step at a real model shape, with random weights made on device.

    python tools/bench_sharded.py --preset gpt-oss-120b --model-parallel 2 --mode low_latency --batch 1,64
    python tools/bench_sharded.py --preset gpt-oss-120b --model-parallel 4 --mode max_throughput --batch 1,64 \
        --dispatch both
    python tools/bench_sharded.py --smoke          # CPU: 8 simulated devices, tiny shape, both modes

Every parameter is generated directly in its sharded placement (`jax.jit(..., out_shardings=...)`) and
in the layout `--impl` reads (the Pallas kernels' expert encoding for `pallas`), so no host copy,
checkpoint or conversion is needed: MXFP4 blocks / words are random bits, scales E8M0 near 2^-6, float
weights N(0, 0.02). `--batch` is sequences per attention rank (a replica group in low_latency, one
device in max_throughput); every sequence sits at position `--context - 1` with its own pages and a
token no other row has (identical rows would all route to the same experts: a too-cheap MoE).
`--dispatch` (max_throughput; low latency has no tokens to dispatch and runs once) picks how tokens
reach their experts' devices: `all_gather` + reduce-scatter, `all_to_all` (ragged), or both. Prints
the median step time of `steps.decode` (one token per sequence, greedy sampling included) and
tokens/s in total, per device and per user, and writes JSON with `--json`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--preset", default="gpt-oss-120b")
ap.add_argument("--model-parallel", type=int, default=None, help="default: all devices (1 replica)")
ap.add_argument("--replicas", type=int, default=1)
ap.add_argument("--mode", choices=("low_latency", "max_throughput", "both"), default="both")
ap.add_argument("--impl", choices=("pallas", "reference"), default="pallas",
                help="kernels (interpreted off-GPU: slow) or the pure-JAX reference")
ap.add_argument("--dispatch", choices=("all_gather", "all_to_all", "both"), default="all_gather")
ap.add_argument("--batch", default="1,64", help="decode sequences per attention rank, comma-separated")
ap.add_argument("--context", type=int, default=1024)
ap.add_argument("--iters", type=int, default=10)
ap.add_argument("--layers", type=int, default=None, help="fewer layers (time scales per layer)")
ap.add_argument("--smoke", action="store_true", help="CPU check: 8 simulated devices, tiny model")
ap.add_argument("--json", default=None)
ARGS = ap.parse_args()
if ARGS.smoke:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dataclasses  # noqa: E402
import math  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from gptoss_jax import checkpoint, config as config_lib, kv_cache, model  # noqa: E402
from pallas_kernels import params as params_lib  # noqa: E402
from gptoss_jax import random_weights, steps  # noqa: E402
from sharding.rules import make_layout  # noqa: E402

PAGE = 16


def _draw(key, name: str, s):
    if name.endswith(("_blocks", "_words")):
        return jax.random.bits(key, s.shape, s.dtype)
    if name.endswith("_scales"):
        return jax.random.randint(key, s.shape, 119, 124, jnp.int32).astype(jnp.uint8)
    if name in ("attn_norm", "mlp_norm", "final_norm"):
        return jnp.ones(s.shape, s.dtype)
    return (0.02 * jax.random.normal(key, s.shape, jnp.float32)).astype(s.dtype)


def random_params(cfg, layout, dtype, impl, seed=0):
    """Every leaf drawn on device in its sharded placement, experts padded and in `impl`'s layout. The
    expert fields (nearly all the bytes) one program each, so temporaries never add up; the rest in one."""
    shapes = layout.padded_shapes(checkpoint.device_shapes(cfg, dtype, impl))
    shardings = jax.tree.leaves(layout.param_shardings(cfg.num_kv_heads, shapes))
    paths, structs = params_lib.field_paths(shapes), jax.tree.leaves(shapes)

    def make(ids):
        fn = lambda: [_draw(jax.random.PRNGKey(seed * 1000 + i), paths[i][-1], structs[i]) for i in ids]
        return dict(zip(ids, jax.jit(fn, out_shardings=[shardings[i] for i in ids])()))

    experts = [i for i, p in enumerate(paths) if p[:2] == ("layers", "experts")]
    leaves = make([i for i in range(len(paths)) if i not in experts])
    for i in experts:
        leaves.update(make([i]))
    return jax.tree.unflatten(jax.tree.structure(shapes), [leaves[i] for i in range(len(paths))])


def bench(cfg, layout, params, impl: str, rows_per_rank: int, context: int, iters: int) -> dict:
    R = layout.num_ranks
    B = R * rows_per_rank
    M = math.ceil((context + 1) / PAGE)
    n_full = rows_per_rank * M + 1
    n_sliding = kv_cache.pool_sizes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 2, cfg.sliding_window, PAGE,
                                    rows_per_rank, 1, None, context + 1)[1]
    dtype = params.embed.dtype
    cache = jax.jit(lambda: model.PagedKVCache.zeros(cfg, R * n_sliding, R * n_full, PAGE, dtype),
                    out_shardings=layout.cache_sharding(cfg.num_kv_heads))()
    rows_np = np.arange(B) % rows_per_rank  # rank-local row index
    full = (1 + rows_np[:, None] * M + np.arange(M)[None]).astype(np.int32)  # rank-local page ids
    sw = math.ceil(cfg.sliding_window / PAGE) + 1
    sliding = np.zeros((B, M), np.int32)
    first = max(0, (context - cfg.sliding_window) // PAGE)
    for b in range(B):
        cols = np.arange(first, min(M, first + sw + 1))
        sliding[b, cols] = 1 + (rows_np[b] * (sw + 1) + np.arange(len(cols))) % (n_sliding - 1)
    put = lambda x: jax.device_put(x, layout.named(layout.batch_spec(x.ndim)))
    tables = model.PageTables(put(sliding), put(full), put(np.zeros(B, np.int32)))
    # a different token per row: identical rows would all route to the same experts (a too-cheap MoE)
    if B > cfg.vocab_size:
        raise SystemExit(f"{B} rows need distinct tokens; the vocabulary has {cfg.vocab_size}")
    tokens = put(np.random.default_rng(B).choice(cfg.vocab_size, B, replace=False).astype(np.int32))
    positions = put(np.full(B, context - 1, np.int32))
    f32 = np.float32
    sp = steps.SamplingBatch(put(np.zeros(B, f32)), put(np.zeros(B, np.int32)), put(np.ones(B, f32)),
                             put(np.zeros(B, f32)), put(np.zeros((B, 2), np.uint32)), put(np.zeros(B, bool)))
    kw = dict(cfg=cfg, impl=impl, layout=layout, num_steps=1, num_top=1)
    t0 = time.perf_counter()
    out, cache = steps.decode(params, cache, tokens, positions, tables, sp, **kw)
    jax.block_until_ready(out)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out, cache = steps.decode(params, cache, tokens, positions, tables, sp, **kw)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    n = layout.mesh.devices.size
    return dict(mode=layout.mode, dispatch=layout.dispatch, impl=impl, devices=n, batch_per_rank=rows_per_rank,
                global_batch=B, step_ms=step * 1e3, tok_s=B / step, tok_s_per_device=B / step / n,
                tok_s_per_user=1 / step, first_call_s=compile_s)


def main():
    if ARGS.smoke:
        raw = dict(random_weights.DEMO_CONFIG, vocab_size=512, num_hidden_layers=4, num_local_experts=4)
        cfg, dtype = config_lib.from_hf_dict(raw), jnp.float32
        devices, iters = 8, 2
    else:
        cfg, dtype = config_lib.preset(ARGS.preset), jnp.bfloat16
        devices, iters = jax.device_count(), ARGS.iters
    if ARGS.layers:
        cfg = dataclasses.replace(cfg, num_layers=ARGS.layers)
    model_parallel = ARGS.model_parallel or devices // ARGS.replicas
    modes = ("low_latency", "max_throughput") if ARGS.mode == "both" else (ARGS.mode,)
    dispatches = ("all_gather", "all_to_all") if ARGS.dispatch == "both" else (ARGS.dispatch,)
    results = []
    print(f"{ARGS.preset if not ARGS.smoke else 'smoke'}: {jax.device_count()} x {jax.devices()[0].device_kind}, "
          f"mesh {ARGS.replicas} replicas x {model_parallel} model, context {ARGS.context}, impl {ARGS.impl}",
          flush=True)
    for mode in modes:
        layout = make_layout(model_parallel, ARGS.replicas, mode)
        t0 = time.perf_counter()
        params = random_params(cfg, layout, dtype, ARGS.impl)
        jax.block_until_ready(params)
        print(f"  {mode}: random weights on device in {time.perf_counter() - t0:.1f} s", flush=True)
        # low latency: tokens are replicated over `model` after attention, nothing to dispatch
        for dispatch in dispatches if mode == "max_throughput" else dispatches[:1]:
            layout = dataclasses.replace(layout, dispatch=dispatch)
            for b in (int(x) for x in ARGS.batch.split(",")):
                r = bench(cfg, layout, params, ARGS.impl, b, ARGS.context, iters)
                results.append(r)
                print(f"  {mode:15s} {dispatch:10s} batch/rank {b:3d} (global {r['global_batch']:4d}): "
                      f"step {r['step_ms']:8.2f} ms, {r['tok_s']:9.1f} tok/s, {r['tok_s_per_device']:8.1f} tok/s "
                      f"per device, {r['tok_s_per_user']:6.1f} tok/s per user", flush=True)
        del params
    if ARGS.json:
        Path(ARGS.json).write_text(json.dumps(dict(args=vars(ARGS), device=str(jax.devices()[0].device_kind),
                                                   results=results), indent=1))


if __name__ == "__main__":
    main()
