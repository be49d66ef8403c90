"""Prefills that hit the prefix cache against the same prompts' prefill without a hit: each round prefills
`--num-requests` new prompts (one output token each), then as many prompts that share each one's first `--shared`
tokens, so their full-layer pages come from the cache. On gpt-oss the sliding layers are not cached: a hit is
recomputed from `shared - sliding layers x (window - 1)` (`KVCacheManager.match_prefix`), so below ~1.5k shared
tokens (20b) the call computes the whole prompt and must cost what the miss costs. With `--trace`, each job's GPU
kernels are summed (`jax.profiler`), the busiest first.

    python -m tools.bench_prefix_cache --preset gpt-oss-20b --shared 881,512,128 --trace --out prefix.json
    python -m tools.bench_prefix_cache --smoke      # tiny model, a CPU check of the script
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from gptoss_jax import config, runtime
from gptoss_jax.engine import Engine
from gptoss_jax.sampling import SamplingParams
from pallas_kernels import KernelConfig
from tools.bench_throughput import SMOKE, parse_setting
from tools.common import commit_id, copy_bandwidth, random_params, resolved, summarize_trace


def run_job(engine: Engine, prompts: list[list[int]], name: str, trace: bool) -> dict:
    """All prompts at once, one output token each: the job's wall time, engine steps and cached prompt tokens;
    traced, the busiest GPU stream's time and top kernels."""
    folder = tempfile.mkdtemp() if trace else None
    if trace:
        jax.profiler.start_trace(folder, create_perfetto_trace=True)
    sp = SamplingParams(temperature=0, max_tokens=1, stop_token_ids=[])
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{name}-{t0}-{i}", p, sp)
    steps, cached = 0, 0
    while engine.has_unfinished_requests():
        steps += 1
        cached += sum(o.num_cached_prompt_tokens for o in engine.step() if o.finished)
    row = {"job": name, "seconds": time.perf_counter() - t0, "engine_steps": steps, "cached_prompt_tokens": cached}
    if trace:
        jax.profiler.stop_trace()
        streams = summarize_trace(folder, top=8)
        if streams:
            busiest = streams[max(streams, key=lambda s: streams[s]["busy_us"])]
            row["gpu_busy_ms"] = busiest["busy_us"] / 1e3
            row["top_kernels_ms"] = [(k["name"], round(k["us"] / 1e3, 2), k["count"]) for k in busiest["top"]]
    return row


def main() -> None:
    runtime.prepare()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-oss-20b")
    ap.add_argument("--smoke", action="store_true", help="tiny model, small jobs: a CPU check of the script")
    ap.add_argument("--num-requests", type=int, default=None, help="prompts a job (default 64; --smoke: 4)")
    ap.add_argument("--input-len", type=int, default=None, help="default 1,024 (--smoke: 64)")
    ap.add_argument("--shared", default=None, help="comma-separated shared prefix lengths (default 881,512,128)")
    ap.add_argument("--config", default="max_throughput", help="engine profile")
    ap.add_argument("--trace", action="store_true", help="sum each job's GPU kernels")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an engine setting over the profile's and --smoke's (VALUE as YAML, repeatable), e.g. max_prefill_seqs=4",
    )
    ap.add_argument("--out", default="prefix_cache.json")
    args = ap.parse_args()
    n = args.num_requests or (4 if args.smoke else 64)
    length = args.input_len or (64 if args.smoke else 1024)
    shared = [int(s) for s in (args.shared or ("40" if args.smoke else "881,512,128")).split(",")]
    if any(not 0 < s < length for s in shared):
        ap.error(f"--shared: each length must be between 0 and --input-len={length}")
    try:
        settings = dict(parse_setting(item) for item in args.set)
    except ValueError as e:
        ap.error(str(e))
    cfg = config.from_hf_dict(SMOKE) if args.smoke else config.preset(args.preset)
    result = {"preset": "smoke" if args.smoke else args.preset, "device": jax.devices()[0].device_kind}
    result.update(jax=jax.__version__, commit=commit_id(), num_requests=n, input_len=length, jobs=[])
    if not args.smoke:  # the same run's copy bandwidth, before the engine takes the memory
        result["copy_TBps"] = copy_bandwidth(warmup=1) / 1e12
        print(f"copy bandwidth {result['copy_TBps']:.2f} TB/s", flush=True)
    kernels = resolved(KernelConfig(impl="auto"))
    smoke = {}
    if args.smoke:
        smoke = dict(kv_cache_tokens=8 * n * length, max_num_batched_tokens=n * length, prefill_chunk_size=length)
    engine = Engine(
        loaded=(cfg, random_params(cfg, kernels)),
        config=args.config,
        progress=False,
        **{
            "max_num_seqs": n,
            "max_model_len": length + 64,
            "min_context_bucket": length + 64,
            "min_prefill_bucket": min(128, length),
            "warmup": True,
            **smoke,
            **settings,
        },
    )
    rng = np.random.default_rng(0)

    def fresh() -> list[list[int]]:
        return [rng.integers(0, cfg.vocab_size - 2, length).tolist() for _ in range(n)]

    run_job(engine, fresh(), "warm-up", False)
    for s in shared:
        base = fresh()
        jobs = [(base, "no hit"), ([p[:s] + q[s:] for p, q in zip(base, fresh())], f"{s} shared")]
        for prompts, name in jobs:
            row = run_job(engine, prompts, name, args.trace)
            result["jobs"].append({"shared": s, **row})
            busy = f", GPU busy {row['gpu_busy_ms']:.0f} ms" if "gpu_busy_ms" in row else ""
            print(
                f"[{name}] {n} x {length}: {row['seconds'] * 1e3:.0f} ms, {row['engine_steps']} steps, "
                f"{row['cached_prompt_tokens']} prompt tokens not computed{busy}",
                flush=True,
            )
            for kernel in row.get("top_kernels_ms", [])[:4]:
                print(f"    {kernel}", flush=True)
    engine.close()
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
