"""The engine's scheduler on an offline job, without a model: the prefill calls it forms (rows x tokens as the runner
pads them), the decode calls' rows, preemptions and the prompt tokens they make the engine compute again. CPU only,
seconds; a device run's figures explained, or a scheduling change tried, before spending GPU time.

The job is `tools.bench_throughput`'s: N requests of IN prompt tokens, each producing exactly OUT, all submitted at
once, under a profile (`--set` overrides as there). Every call's tokens land before the next step is scheduled (the
engine runs one step ahead; the shapes are the same). `--full-pages`: the full-layer pool, as the engine's start-up
line prints it ("engine ready (..., N full pages)"), per attention rank.

    python -m tools.simulate_scheduler --jobs 8192/1024x512 --set max_num_seqs=256 --full-pages 475571
    python -m tools.simulate_scheduler --jobs 8192/1024x384 --set max_num_seqs=256 --full-pages 110384
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from gptoss_jax import config, engine_config, kv_cache
from gptoss_jax.engine_config import bucket, padded_rows
from gptoss_jax.sampling import SamplingParams
from gptoss_jax.scheduler import Scheduler, Sequence
from tools.bench_throughput import parse_jobs, parse_setting


def simulate(ec: engine_config.EngineConfig, mc, requests: int, input_len: int, output_len: int, full_pages: int):
    """Run the job through `Scheduler` -> a summary dict (see `main`)."""
    sliding_pages = kv_cache.engine_sliding_pages(ec, mc.sliding_window)  # as the engine sizes it
    kv = kv_cache.KVCacheManager(
        full_pages, sliding_pages, ec.page_size, mc.sliding_window, (mc.num_layers + 1) // 2, ec.enable_prefix_caching
    )
    s = Scheduler(ec, kv)
    for i in range(requests):  # distinct prompts: no prefix-cache hits between requests
        prompt = [(i * input_len + t) % mc.vocab_size for t in range(input_len)]
        params = SamplingParams(max_tokens=output_len, ignore_eos=True)
        s.add(Sequence(str(i), prompt, input_len, params, (0, 0), input_len + output_len))
    shapes, rows, computed, padded, steps = collections.Counter(), [], 0, 0, 0
    while s.waiting or s.running:
        work = s.schedule()
        if work.empty:
            raise RuntimeError(
                f"step {steps}: nothing scheduled with {len(s.waiting)} waiting, {len(s.running)} running"
            )
        s.launched(work)
        steps += 1
        if work.prefills:
            R = padded_rows([len(work.prefills)], ec.prefill_row_buckets())
            T = bucket(max(c.num_tokens for c in work.prefills), ec.prefill_token_buckets())
            shapes[f"{R}x{T}"] += 1
            padded += R * T
            computed += sum(c.num_tokens for c in work.prefills)
        if work.decodes:
            rows.append(len(work.decodes))
        for seq in list(s.running):
            seq.token_ids += [0] * seq.num_pending
            seq.num_pending = 0
            if len(seq.token_ids) >= seq.max_len:
                s.remove(seq)
    prompt_tokens = requests * input_len
    return dict(
        steps=steps,
        prefill_calls=sum(shapes.values()),
        prefill_shapes=dict(shapes.most_common()),
        prompt_tokens=prompt_tokens,
        prefill_tokens_computed=computed,
        prefill_tokens_padded=padded,
        recomputed=computed - prompt_tokens,
        padding=padded / computed,
        decode_calls=len(rows),
        decode_rows_mean=sum(rows) / max(len(rows), 1),
        preemptions=s.num_preemptions,
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-oss-20b")
    ap.add_argument("--jobs", default="8192/1024x512", help="as tools.bench_throughput's: IN/OUT[xN][:KEY=VALUE;...]")
    ap.add_argument("--num-requests", type=int, default=256, help="requests of a job that names no count")
    ap.add_argument("--config", default="max_throughput", help="engine profile")
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE engine setting for every job (repeatable)")
    ap.add_argument("--full-pages", type=int, required=True, help="the full-layer pool's pages, per attention rank")
    ap.add_argument("--out", default="", help="write the summaries as JSON here")
    args = ap.parse_args(argv)
    try:
        settings = dict(parse_setting(item) for item in args.set)
        jobs = parse_jobs(args.jobs, args.num_requests, args.config)
    except ValueError as e:
        ap.error(str(e))
    mc = config.preset(args.preset)
    out = []
    for name, profile, n, input_len, output_len, own in jobs:
        job_settings = {**settings, **own}
        chunk = engine_config.load(profile, **job_settings).prefill_chunk_size
        # as tools.bench_throughput sets it: no token bucket below the prompt (or chunk) length
        ec = engine_config.load(profile, **{**job_settings, "min_prefill_bucket": min(input_len, chunk)})
        r = dict(job=name, requests=n, **simulate(ec, mc, n, input_len, output_len, args.full_pages))
        out.append(r)
        print(json.dumps(r), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
