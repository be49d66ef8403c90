"""Decode benchmark: the engine's compiled decode step at batch x context points, against the roofline.

For each model, batch (1, 4, 16, 64, 256) and context (1k, 8k): random weights at the real shape
drawn on device, a KV cache with every row's context laid out in pages exactly as the engine lays
it out (synthetic tables, so no million-token prefill is needed), then `steps.decode` -- model,
sampling and cache writes, `--steps` tokens per call as the low-latency profile does -- timed.
Reports TPOT, output tok/s per user and per GPU, and the fraction of the memory roofline: the bytes
the step must read (weights once, distinct routed experts, unembedding, visible KV) over the copy
bandwidth measured in the same run. Host scheduling is not in these figures (tools/bench_throughput.py
measures the whole engine loop). `--reference` adds the pure-JAX path for the ratio.

    python tools/bench_decode.py --presets gpt-oss-20b,gpt-oss-120b --out $OUT/decode.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from gptoss_jax import config, model, steps  # noqa: E402
from pallas_kernels import params as params_lib  # noqa: E402
from gptoss_jax.engine_config import EngineConfig  # noqa: E402
from gptoss_jax.random_weights import random_params  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_reference import decode_bytes, timeit  # noqa: E402

PAGE = 16
# The log-probability alternatives the engine compiles its steps for (`EngineConfig.max_logprobs`): the
# branch that computes them decides whether a call blocks the host (docs/BENCHMARKS.md §4d).
NUM_TOP = EngineConfig().max_logprobs


def copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s (read + write), XLA elementwise over 4 GiB."""
    x = jax.random.bits(jax.random.PRNGKey(0), (1 << 30,), jnp.uint32)
    inc = jax.jit(lambda a: a + 1)
    t = timeit(lambda: inc(x).block_until_ready(), warmup=1, reps=10)
    return 2 * 4 * (1 << 30) / t


def synthetic_state(cfg, batch: int, context: int, dtype):
    """A cache and page tables in which each row holds `context` tokens, as the engine would lay them out."""
    full_pages = math.ceil((context + 1) / PAGE)
    sliding_pages = math.ceil((cfg.sliding_window + 1) / PAGE) + 1
    width = full_pages
    cache = model.PagedKVCache.zeros(cfg, 1 + batch * sliding_pages, 1 + batch * full_pages, PAGE, dtype)
    full = 1 + np.arange(batch * full_pages, dtype=np.int32).reshape(batch, full_pages)
    sliding = np.zeros((batch, width), np.int32)  # pages before the window stay on the null page
    first = (context - cfg.sliding_window) // PAGE
    for b in range(batch):
        cols = np.arange(max(first, 0), full_pages)
        sliding[b, cols] = 1 + b * sliding_pages + (cols % sliding_pages)
    tables = model.PageTables(jnp.asarray(sliding), jnp.asarray(full), jnp.zeros(batch, jnp.int32))
    return cache, tables


def row_tokens(cfg, batch: int) -> jax.Array:
    """A different token in every row. Identical rows would all route to the same k experts, so a
    batch would read only k experts per layer instead of ~all of them (an unrealistically cheap step)."""
    return jnp.asarray(np.random.default_rng(batch).integers(0, cfg.vocab_size, batch), jnp.int32)


def model_config(name: str):
    """A preset name, or a config.json path (`config.load_config`)."""
    return config.load_config(name) if name.endswith(".json") else config.preset(name)


def decode_call(params, cfg, batch: int, context: int, impl: str, num_steps: int, temperature: float = 0.0,
                top_p: float = 1.0, ahead: bool = False):
    """`(run, free)`: `run()` makes one compiled decode call (`num_steps` tokens for every row of a
    synthetic `context`-token batch) and blocks until it is done (`run(block=False)` returns its
    tokens as soon as the call returns); `free()` releases its cache. Sampling is greedy unless
    `temperature` > 0. `ahead`: compile now, so later changes to module constants do not reach `run`."""
    cache, tables = synthetic_state(cfg, batch, context, params.embed.dtype)
    sp = steps.SamplingBatch(temperature_B=jnp.full(batch, temperature), top_k_B=jnp.zeros(batch, jnp.int32),
                             top_p_B=jnp.full(batch, top_p), min_p_B=jnp.zeros(batch),
                             keys_B2=jnp.zeros((batch, 2), jnp.uint32), want_logprobs_B=jnp.zeros(batch, bool))
    tokens = row_tokens(cfg, batch)
    positions = jnp.full(batch, context, jnp.int32)
    state = {"cache": cache}
    static = dict(cfg=cfg, impl=impl, num_steps=num_steps, num_top=NUM_TOP)
    step = (steps.decode.lower(params, cache, tokens, positions, tables, sp, **static).compile() if ahead
            else functools.partial(steps.decode, **static))

    def run(block: bool = True):
        out, state["cache"] = step(params, state["cache"], tokens, positions, tables, sp)
        return out.tokens.block_until_ready() if block else out.tokens

    def free():
        for buf in jax.tree.leaves(state["cache"]):
            buf.delete()

    return run, free


def time_decode(params, cfg, batch, context, impl, num_steps, reps) -> float:
    run, free = decode_call(params, cfg, batch, context, impl, num_steps)
    t = timeit(run, warmup=1, reps=reps)
    free()
    return t / num_steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="gpt-oss-20b,gpt-oss-120b")
    ap.add_argument("--batches", default="1,4,16,64,256")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--steps", type=int, default=8, help="decode tokens per device call (multi-step)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--reference", default="1,64",
                    help="batches also run on the reference path (first preset, first context)")
    ap.add_argument("--memory-gib", type=float, default=None, help="device memory to plan with (default: read)")
    ap.add_argument("--out", default="decode.json")
    args = ap.parse_args()

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    bw = copy_bandwidth()
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "commit": commit or "unknown",
              "copy_TBps": bw / 1e12, "steps_per_call": args.steps, "rows": []}
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    limit = (args.memory_gib * 2**30 if args.memory_gib else
             (jax.devices()[0].memory_stats() or {}).get("bytes_limit", 0))
    contexts = [int(c) for c in args.contexts.split(",")]
    ref_batches = {int(b) for b in args.reference.split(",") if b}
    for n, preset in enumerate(args.presets.split(",")):
        cfg = model_config(preset)
        with_reference = n == 0 and ref_batches
        kernel_params = random_params(cfg, impl="pallas")  # drawn in the kernels' layout, layer by layer
        params = random_params(cfg) if with_reference else None
        weights = params_lib.nbytes(kernel_params)
        for context in contexts:
            for batch in [int(b) for b in args.batches.split(",")]:
                kv = batch * (context + 2 * PAGE) * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2 / 2
                if limit and weights + kv > 0.9 * limit:
                    print(f"{preset} B={batch} ctx={context}: skipped ({(weights + kv) / 2**30:.0f} GiB > memory)")
                    continue
                impls = ["pallas"] + (["reference"] if with_reference and batch in ref_batches and context == contexts[0]
                                      else [])
                for impl in impls:
                    p = kernel_params if impl == "pallas" else params
                    tpot = time_decode(p, cfg, batch, context, impl, args.steps, args.reps)
                    need = decode_bytes(cfg, batch, context)
                    row = {"preset": preset, "impl": impl, "batch": batch, "context": context, "tpot_ms": tpot * 1e3,
                           "tok_s_per_user": 1 / tpot, "tok_s_per_gpu": batch / tpot, "min_bytes": need,
                           "roofline_fraction": need / tpot / bw}
                    result["rows"].append(row)
                    print(f"{preset} {impl:9s} B={batch:3d} ctx={context:5d}: TPOT {tpot * 1e3:7.2f} ms, "
                          f"{1 / tpot:7.1f} tok/s/user, {batch / tpot:8.0f} tok/s/GPU, "
                          f"{100 * row['roofline_fraction']:5.1f}% of roofline", flush=True)
        del params, kernel_params
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
