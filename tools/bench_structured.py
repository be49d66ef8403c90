"""Structured outputs at batch scale: decode throughput with a fraction of the requests constrained by a JSON schema
against none constrained, the host's time per constrained token, and the sampler's cost of the token mask.

Each job submits `--num-requests` requests of `--input-len` random prompt tokens at once under the max_throughput
profile, `--output-len` tokens each (stop tokens off for the free ones; the constrained ones end at their JSON's
end, which the engine steers to just before `--output-len`). Random weights at the real shape never open a reasoning
message, so the constrained rows are under the grammar (masks from the host, rejected free draws) from
their first token: the worst case. Weights are random, drawn on device in the kernels' layout; the o200k tokenizer
comes from `--tokenizer` (default: shared/tokenizer in or beside the checkout, else the usual lookup:
$TIKTOKEN_ENCODINGS_BASE, $GPTOSS_JAX_HOME/tokenizer).

    python -m tools.bench_structured --preset gpt-oss-20b --out docs/results/structured_20b_h200.json
    python -m tools.bench_structured --smoke                      # the demo model's shape, a CPU check
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gptoss_jax import config, engine_config, runtime, sampling, structured
from gptoss_jax import tokenizer as tokenizer_lib
from gptoss_jax.random_weights import DEMO_CONFIG
from gptoss_jax.sampling import SamplingParams
from pallas_kernels import KernelConfig
from tools.bench_throughput import TimedEngine, parse_setting
from tools.common import commit_id, copy_bandwidth, random_params, resolved, timeit

# Long enough to fill any output length: the engine steers it to its end near max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "tags": {"type": "array", "items": {"type": "string"}},
        "notes": {"type": "array", "items": {"type": "object", "properties": {"text": {"type": "string"}}}},
    },
    "required": ["title", "year", "tags", "notes"],
}


class StructuredEngine(TimedEngine):
    """`TimedEngine` that also sums the host's time in the constraints' `accept` (consume the token, fast-forward,
    compute the next mask) and counts the tokens it saw."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.accept_s, self.accepts = 0.0, 0

    def _constraint(self, *args):
        c = super()._constraint(*args)
        if c is not None:
            accept, engine = c.accept, self

            def timed(tokens, gate=None):
                t0 = time.perf_counter()
                try:
                    return accept(tokens, gate)
                finally:
                    engine.accept_s += time.perf_counter() - t0
                    engine.accepts += 1

            c.accept = timed
        return c


def run_job(engine: StructuredEngine, prompts: list[list[int]], output_len: int, constrained: int) -> dict:
    """All requests at once; the first `constrained` of them under `SCHEMA`."""
    free = SamplingParams(temperature=1.0, max_tokens=output_len, stop_token_ids=[], seed=0)
    so = structured.StructuredOutputsParams(json=SCHEMA)
    json_sp = SamplingParams(temperature=1.0, max_tokens=output_len, seed=0, structured_outputs=so)
    engine.accept_s, engine.accepts = 0.0, 0
    engine.timers.clear()
    tokens: collections.Counter = collections.Counter()
    texts: dict[str, list[int]] = collections.defaultdict(list)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{'json' if i < constrained else 'free'}-{i}", p, json_sp if i < constrained else free)
    t_added = time.perf_counter()
    first, late = {}, []  # late: (time, tokens) of outputs once every request has its first token
    steps, late_steps = 0, 0  # engine steps: all, and once every request has its first token
    while engine.has_unfinished_requests():
        steps += 1
        late_steps += len(first) == len(prompts)
        for o in engine.step():
            kind = o.request_id.split("-")[0]
            tokens[kind] += len(o.new_token_ids)
            if o.new_token_ids:
                now = time.perf_counter()
                first.setdefault(o.request_id, now)
                if len(first) == len(prompts):
                    late.append((now, len(o.new_token_ids)))
            if kind == "json":
                texts[o.request_id] += o.new_token_ids
    elapsed = time.perf_counter() - t0
    decode_s = late[-1][0] - late[0][0] if len(late) > 1 else None
    valid = 0
    for ids in texts.values():
        text = engine.tokenizer.decode(ids)
        try:
            json.loads(text.split("<|message|>", 1)[1])
            valid += 1
        except (IndexError, ValueError):
            pass
    n_out = sum(tokens.values())
    return {
        "requests": len(prompts),
        "constrained": constrained,
        "constrained_valid_json": valid,
        "seconds": elapsed,
        "add_requests_s": t_added - t0,
        "output_tokens": dict(tokens),
        "output_tok_s": n_out / elapsed,
        "free_output_tok_s": tokens["free"] / elapsed,
        "engine_steps": steps,
        "decode_phase_steps": late_steps,
        "decode_phase_s": elapsed - (max(first.values()) - t0) if first else None,
        # Output tok/s once every request has its first token (prefill over): the decode throughput
        "decode_tok_s": sum(n for _, n in late[1:]) / decode_s if decode_s else None,
        "host_s": dict(engine.timers),
        "host_accept_us_per_token": 1e6 * engine.accept_s / max(engine.accepts, 1),
        "constrained_tokens_per_accept": tokens["json"] / max(engine.accepts, 1),
        "host_accept_s": engine.accept_s,
        "num_compiles": engine.stats().num_compiles,
    }


def sampler_cost(batch: int, vocab: int) -> dict:
    """`sampling.sample_batch` at temperature 1 on `[batch, vocab]` logits: no masked row (the `lax.cond` skips the
    mask), and half the rows masked."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(batch, vocab)), jnp.float32)
    words = structured.mask_words(vocab)
    mask = jnp.asarray(rng.integers(-(2**31), 2**31, (batch, words)), jnp.int32)

    def sb(masked):
        return sampling.SamplingBatch(
            jnp.ones(batch, jnp.float32),
            jnp.zeros(batch, jnp.int32),
            jnp.ones(batch, jnp.float32),
            jnp.zeros(batch, jnp.float32),
            jnp.zeros((batch, 2), jnp.uint32),
            jnp.zeros(batch, bool),
            jnp.asarray(masked),
            mask,
            jnp.zeros(batch, jnp.int32),
            jnp.zeros(batch, bool),
            jnp.tile(jnp.asarray([0.0, 0.0, 1.0]), (batch, 1)),  # no logits processor
            jnp.zeros((batch, 4), jnp.int32),
        )

    fn = jax.jit(sampling.sample_batch, static_argnums=3)
    pos = jnp.zeros(batch, jnp.int32)
    none, half = sb(np.zeros(batch, bool)), sb(np.arange(batch) % 2 == 0)
    return {
        "batch": batch,
        "no_masked_row_ms": 1e3 * timeit(lambda: fn(logits, pos, none, 1).tokens, reps=20),
        "half_rows_masked_ms": 1e3 * timeit(lambda: fn(logits, pos, half, 1).tokens, reps=20),
    }


def main() -> None:
    runtime.prepare()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-oss-20b")
    ap.add_argument("--smoke", action="store_true", help="the demo model's shape and a short job: a CPU check")
    ap.add_argument("--num-requests", type=int, default=None, help="default 64 (--smoke: 8)")
    ap.add_argument("--input-len", type=int, default=None, help="default 1,024 (--smoke: 32)")
    ap.add_argument("--output-len", type=int, default=None, help="default 512 (--smoke: 64)")
    ap.add_argument("--fractions", default="0,0.5", help="comma-separated fractions of constrained requests")
    ap.add_argument("--config", default="max_throughput", help="engine profile")
    ap.add_argument("--tokenizer", default=None, help="o200k_base.tiktoken or its folder")
    ap.add_argument(
        "--min-prefill-bucket",
        type=int,
        default=128,
        help="smallest prefill bucket: the tokens a grammar forces (a header, a key) are prefilled in small chunks",
    )
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="engine setting (repeatable)")
    ap.add_argument("--out", default="structured.json")
    args = ap.parse_args()
    repo = Path(__file__).resolve().parents[1]
    shared = [p for p in (repo / "shared" / "tokenizer", repo.parent / "shared" / "tokenizer") if p.exists()]
    enc = tokenizer_lib.load(args.tokenizer or (shared[0] if shared else None))
    defaults = (8, 32, 64) if args.smoke else (64, 1024, 512)
    for name, default in zip(("num_requests", "input_len", "output_len"), defaults):
        setattr(args, name, getattr(args, name) or default)
    overrides = {"max_num_seqs": args.num_requests}  # the batch, and no decode bucket above it to compile
    if args.smoke:
        cfg = config.from_hf_dict(DEMO_CONFIG)
        overrides.update(
            decode_batch_buckets=[args.num_requests],
            max_prefill_seqs=2,
            prefill_chunk_size=64,
            max_num_batched_tokens=128,
            kv_cache_tokens=max(4096, 2 * args.num_requests * (args.input_len + args.output_len)),
        )
    else:
        cfg = config.preset(args.preset)
    overrides.update(parse_setting(item) for item in args.set)
    kernels = resolved(KernelConfig(impl="auto"))
    import llguidance

    result = {
        "preset": "smoke (demo shape)" if args.smoke else args.preset,
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "llguidance": llguidance.__version__,
        "commit": commit_id(),
        "schema": SCHEMA,
        "jobs": [],
    }
    if not args.smoke:  # the same run's ceiling (before the engine takes the memory)
        result["copy_TBps"] = copy_bandwidth(warmup=1) / 1e12
        print(f"copy bandwidth {result['copy_TBps']:.2f} TB/s", flush=True)
    result["sampler"] = sampler_cost(args.num_requests, cfg.vocab_size)
    print(f"sampler: {result['sampler']}", flush=True)
    params = random_params(cfg, kernels)
    max_len = args.input_len + args.output_len
    t0 = time.perf_counter()
    engine = StructuredEngine(
        loaded=(cfg, params),
        config=args.config,
        tokenizer=enc,
        progress=False,
        **{
            **overrides,
            "max_model_len": max_len,
            "min_context_bucket": max_len,
            "warmup": True,
            "min_prefill_bucket": min(
                args.min_prefill_bucket, engine_config.load(args.config, **overrides).prefill_chunk_size
            ),
        },
    )
    print(f"engine ready in {time.perf_counter() - t0:.1f}s ({engine.stats().num_compiles} programs)", flush=True)
    rng = np.random.default_rng(0)

    def fresh() -> list[list[int]]:  # new prompts for each job: a job on the last one's would hit the prefix cache
        return [rng.integers(0, 199_998, args.input_len).tolist() for _ in range(args.num_requests)]

    run_job(engine, fresh()[:2], 8, 1)  # the first constraint builds llguidance's tokenizer (~1 s)
    for fraction in (float(f) for f in args.fractions.split(",")):
        n = round(fraction * args.num_requests)
        row = run_job(engine, fresh(), args.output_len, n)
        row.update(fraction=fraction, config=args.config, decode_steps_per_call=engine.config.decode_steps_per_call)
        result["jobs"].append(row)
        print(
            f"{n}/{args.num_requests} constrained: {row['output_tok_s']:.0f} output tok/s, decode phase "
            f"{row['decode_tok_s'] or 0:.0f} tok/s "
            f"(free rows {row['free_output_tok_s']:.0f}), {row['seconds']:.1f}s, "
            f"{row['engine_steps']} engine steps ({row['decode_phase_steps']} in the decode phase), "
            f"tokens {row['output_tokens']}, "
            f"valid JSON {row['constrained_valid_json']}/{n}, host accept {row['host_accept_us_per_token']:.0f} us "
            f"per call ({row['host_accept_s']:.2f}s, {row['constrained_tokens_per_accept']:.2f} tokens kept per call), "
            f"compiles {row['num_compiles']}",
            flush=True,
        )
    first_job = result["jobs"][0]
    for row in result["jobs"][1:]:
        row["vs_first_job"] = row["output_tok_s"] / first_job["output_tok_s"]
        row["decode_vs_first_job"] = (row["decode_tok_s"] or 0) / (first_job["decode_tok_s"] or 1)
    if len(result["jobs"]) > 1:
        print(
            "vs the first job: output "
            + ", ".join(f"{r['vs_first_job']:.3f}" for r in result["jobs"][1:])
            + "; decode phase "
            + ", ".join(f"{r['decode_vs_first_job']:.3f}" for r in result["jobs"][1:])
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"wrote {args.out}; median host accept per call over jobs: "
        f"{statistics.median([r['host_accept_us_per_token'] for r in result['jobs']]):.0f} us"
    )


if __name__ == "__main__":
    main()
