"""Baseline of the pure-JAX reference path on one GPU: write, load, prefill and decode at a real shape.

Writes a random MXFP4 checkpoint at the 20b (or 120b) shape to local disk, loads it through the
real loader (time, device memory), then times the engine's jitted prefill and decode steps (paged cache,
identity block tables). Ceilings are measured in the same run: device copy bandwidth (XLA, and torch if present) and
the bf16 matmul rate. Usage (on the GPU machine):

    python tools/bench_reference.py --preset gpt-oss-20b --out $OUT/reference.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from gptoss_jax import checkpoint, config, model, random_weights, steps  # noqa: E402


def timeit(fn, warmup=2, reps=10) -> float:
    """Median wall time of `fn()` (which must block until its device work is done), in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ceilings(n_words: int = 1 << 30, n_mm: int = 8192) -> dict:
    out = {}
    x = jax.random.bits(jax.random.PRNGKey(0), (n_words,), jnp.uint32)  # 4 GiB by default
    inc = jax.jit(lambda a: a + 1)
    t = timeit(lambda: inc(x).block_until_ready())
    out["xla_u32_add_TBps"] = 2 * x.nbytes / t / 1e12
    del x
    a = jax.random.normal(jax.random.PRNGKey(1), (n_mm, n_mm), jnp.bfloat16)
    b = jax.random.normal(jax.random.PRNGKey(2), (n_mm, n_mm), jnp.bfloat16)
    mm = jax.jit(lambda p, q: p @ q)
    t = timeit(lambda: mm(a, b).block_until_ready())
    out["xla_bf16_matmul_TFLOPs"] = 2 * n_mm ** 3 / t / 1e12
    del a, b
    try:
        import torch
        src = torch.empty(1 << 30, dtype=torch.int32, device="cuda").random_()
        dst = torch.empty_like(src)
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for i in range(12):
            ev0.record()
            dst.copy_(src)
            ev1.record()
            torch.cuda.synchronize()
            if i >= 2:
                ts.append(ev0.elapsed_time(ev1) / 1e3)
        out["torch_copy_TBps"] = 2 * src.numel() * 4 / statistics.median(ts) / 1e12
        del src, dst
        torch.cuda.empty_cache()
    except Exception as e:  # torch is optional: the XLA figure stands alone
        out["torch_copy_error"] = repr(e)
    return out


def decode_bytes(cfg: config.ModelConfig, batch: int, context: int) -> float:
    """Fewest bytes one decode step must read: non-expert weights, the distinct routed experts
    (expected count for uniform routing), the unembedding, and the visible KV cache."""
    D, I, E, k = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.experts_per_token
    H, N, K = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    attn = 2 * (D * H * (N + 2 * K) + N * H * D) + 2 * E * D
    expert = (2 * I * D + D * I) * 4.25 / 8 + 2 * (2 * I + D)
    distinct = E * (1 - (1 - k / E) ** batch)
    kv_per_tok = 2 * K * H * 2
    kv = sum(batch * kv_per_tok * (min(context, cfg.sliding_window) if cfg.is_sliding(l) else context)
             for l in range(cfg.num_layers))
    return cfg.num_layers * (attn + distinct * expert) + 2 * cfg.vocab_size * D + kv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-oss-20b", help="preset name, or a HF config.json path")
    ap.add_argument("--smoke", action="store_true", help="tiny ceilings, for a CPU check of the script")
    ap.add_argument("--ckpt-dir", default="/tmp/gptoss-random")
    ap.add_argument("--prefill", default="128,1024")
    ap.add_argument("--decode-batch", default="1,8,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", default="reference.json")
    args = ap.parse_args()

    result = {"preset": args.preset, "device": str(jax.devices()[0].device_kind), "jax": jax.__version__}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result["commit"] = commit or "unknown"
    result["ceilings"] = ceilings(1 << 20, 256) if args.smoke else ceilings()
    print("ceilings", result["ceilings"], flush=True)

    preset_file = Path(args.preset) if args.preset.endswith(".json") else config.PRESETS_DIR / f"{args.preset}.json"
    hf = json.loads(preset_file.read_text())
    t0 = time.perf_counter()
    path = random_weights.write_checkpoint(args.ckpt_dir, hf, seed=0)
    result["write_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    cfg, params = checkpoint.load_params(path, jnp.bfloat16)
    jax.block_until_ready(params)
    result["load_s"] = time.perf_counter() - t0
    stats = jax.devices()[0].memory_stats() or {}
    result["param_bytes"] = sum(x.nbytes for x in jax.tree.leaves(params))
    result["device_bytes_in_use_after_load"] = stats.get("bytes_in_use")
    result["device_peak_bytes_during_load"] = stats.get("peak_bytes_in_use")
    print(f"loaded in {result['load_s']:.1f}s; params {result['param_bytes'] / 2**30:.2f} GiB", flush=True)

    def paged(B: int, S: int, page: int = 16):
        """A cache and identity block tables for B rows of S positions (page 0 is the null page)."""
        n = -(-S // page)
        table = 1 + jnp.arange(B * n, dtype=jnp.int32).reshape(B, n)
        tables = model.PageTables(table, table, jnp.zeros((B,), jnp.int32))
        return model.PagedKVCache.zeros(cfg, B * n + 1, B * n + 1, page, jnp.bfloat16), tables

    def greedy(B: int) -> steps.SamplingBatch:
        z = jnp.zeros((B,), jnp.float32)
        return steps.SamplingBatch(z, jnp.zeros((B,), jnp.int32), z + 1, z, jnp.zeros((B, 2), jnp.uint32),
                                   jnp.zeros((B,), bool))

    result["prefill"] = []
    for T in [int(t) for t in args.prefill.split(",")]:
        cache, tables = paged(1, T)
        tokens = jax.random.randint(jax.random.PRNGKey(T), (1, T), 0, cfg.vocab_size)
        positions = jnp.arange(T, dtype=jnp.int32)[None]
        state = {"cache": cache}

        def run():
            out, state["cache"] = steps.prefill(params, state["cache"], tokens, positions, tables,
                                                jnp.asarray([T - 1], jnp.int32), greedy(1), cfg=cfg,
                                                impl="reference", num_top=1)
            out.tokens.block_until_ready()

        t = timeit(run, warmup=1, reps=5)
        result["prefill"].append({"tokens": T, "step_s": t, "tokens_per_s": T / t})
        print(f"prefill T={T}: {t * 1e3:.1f} ms ({T / t:.0f} tok/s)", flush=True)
        del state, cache

    result["decode"] = []
    bw = max(result["ceilings"].get("torch_copy_TBps", 0), result["ceilings"]["xla_u32_add_TBps"]) * 1e12
    for B in [int(b) for b in args.decode_batch.split(",")]:
        cache, tables = paged(B, args.context + 16)
        state = {"cache": cache}
        toks = jnp.zeros((B,), jnp.int32)
        pos = jnp.full((B,), args.context, jnp.int32)

        def run():
            out, state["cache"] = steps.decode(params, state["cache"], toks, pos, tables, greedy(B), cfg=cfg,
                                               impl="reference", num_steps=1, num_top=1)
            out.tokens.block_until_ready()

        t = timeit(run)
        need = decode_bytes(cfg, B, args.context)
        row = {"batch": B, "context": args.context, "step_s": t, "tok_per_s_per_user": 1 / t,
               "tok_per_s_total": B / t, "min_bytes": need, "roofline_fraction": need / t / bw}
        result["decode"].append(row)
        print(f"decode B={B} ctx={args.context}: {t * 1e3:.2f} ms/step, {B / t:.0f} tok/s total, "
              f"{100 * row['roofline_fraction']:.1f}% of copy-bandwidth roofline", flush=True)
        del state, cache
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
