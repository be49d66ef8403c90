"""Speculative decoding benchmarks on random weights at the real shapes (so real acceptance means nothing: the oracle
drafter proposes the known greedy continuation and is forced to a chosen acceptance length).

1. verify: one `steps.decode_speculative` call (k drafts + 1 token per row, oracle drafter) against one plain decode
   step (k = 0), k = 1..7, at batch 1 (and `--verify-batches`), context `--input-len`;
2. drafters: the cost of the n-gram and oracle drafters' `propose` alone, per call; and an EAGLE-3 drafter's (a random
   one at the published gpt-oss shape: one Llama layer as wide as the target, MLP 6x, 32,000 draft ids, the
   target's embedding shared): its `propose` after a verify step of k + 1 accepted rows (first pass and k - 1 draft
   steps) and one draft step alone, at context `--input-len` (`--method eagle3` times only this);
3. end to end: `--concurrency` requests at once (1, 8, 32) of `--input-len` random prompt tokens and `--output-len`
   greedy output tokens, without speculation (its outputs become the oracle's continuations), then with the oracle
   at each `--acceptance-lengths` (2.5, 3.0, 3.5), k = `--k`: output tok/s and the measured acceptance length. The
   oracle's drafts are accepted by its schedule (`force_acceptance`), not by comparison with the target's tokens:
   the work per step is the same, and on random bf16 weights a continuation computed beforehand does not survive
   (the verify step's kernels round differently from a one-token step's and near-tied logits flip; measured at
   3725b49: acceptance 1.00 with `--exact-acceptance`).

    python -m tools.bench_speculative --preset gpt-oss-20b --out $OUT/spec.json
    python -m tools.bench_speculative --preset gpt-oss-120b --skip verify --concurrency 1
    python -m tools.bench_speculative --preset gpt-oss-120b --method eagle3 --verify-batches 1,8,32
    python -m tools.bench_speculative --smoke                       # tiny model, CPU check
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gptoss_jax import config, eagle3, random_weights, runtime, speculative
from gptoss_jax.engine import Engine
from gptoss_jax.sampling import SamplingParams
from pallas_kernels import KernelConfig
from tools.bench_throughput import SMOKE, SMOKE_ENGINE, parse_setting
from tools.common import commit_id, copy_bandwidth, decode_step, random_params, resolved, speculative_step, timeit


def verify_times(params, cfg, kernels, ks, batches, context) -> list[dict]:
    """Per batch: the plain decode step (k = 0) and the verify step of each k, ms per call (median)."""
    rows = []
    for B in batches:
        step = decode_step(params, cfg, B, context, kernels)
        plain = timeit(step) * 1e3
        step.free()
        rows.append({"batch": B, "k": 0, "ms": plain})
        print(f"[verify] batch {B}: plain decode step {plain:.3f} ms", flush=True)
        for k in ks:
            spec = speculative.SpeculativeConfig("oracle", k)
            drafter = speculative.make_drafter(spec, cfg.vocab_size, context + k + 2)
            step = speculative_step(params, cfg, B, context, kernels, drafter, draft_params=drafter.params(spec))
            ms = timeit(step) * 1e3
            step.free()
            rows.append({"batch": B, "k": k, "ms": ms})
            print(f"[verify] batch {B}: k={k} verify step {ms:.3f} ms ({ms / plain:.2f}x)", flush=True)
    return rows


def drafter_times(cfg, k: int, batch: int, context: int) -> list[dict]:
    """The drafters' `propose` alone (jit, ms per call) on a random history."""
    out = []
    specs = [
        speculative.SpeculativeConfig("ngram", k, prompt_lookup_min=2, prompt_lookup_max=4),
        speculative.SpeculativeConfig("oracle", k),
    ]
    for spec in specs:
        drafter = speculative.make_drafter(spec, cfg.vocab_size, context + k + 2)
        hist = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch + 1, drafter.history_tokens), np.int32)
        state = speculative.DraftState(jax.device_put(hist), *jax.device_put(np.zeros((2, batch + 1), np.int32)))
        inp = speculative.DraftInputs(
            jax.device_put(hist[:batch, 0]),
            jax.device_put(np.full(batch, context, np.int32)),
            jax.device_put(np.arange(batch, dtype=np.int32)),
            jax.device_put(np.zeros((batch, 2), np.uint32)),
        )
        params = drafter.params(spec) if hasattr(drafter, "params") else None
        fn = jax.jit(lambda s, i, p, d=drafter: d.propose(p, s, i).tokens_BK)
        ms = timeit(lambda: fn(state, inp, params).block_until_ready()) * 1e3
        out.append({"method": spec.method, "k": k, "batch": batch, "ms": ms})
        print(f"[drafter] {spec.method} k={k} batch {batch}: {ms:.3f} ms per call", flush=True)
    return out


def random_drafter(cfg, dtype=jnp.bfloat16) -> tuple[eagle3.Eagle3Config, eagle3.DrafterParams]:
    """A random EAGLE-3 drafter for `cfg` in the published layout's shapes (`random_weights.eagle3_config`), built on
    the device, with an embedding of its own (the lookup costs the same shared or not); draft id i is target id i."""
    hf = dict(
        num_hidden_layers=cfg.num_layers,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
    )
    dcfg = eagle3.from_hf_dict(random_weights.eagle3_config(hf), cfg, "random drafter")
    key = jax.random.PRNGKey(0)
    values = {"d2t": jnp.zeros((dcfg.draft_vocab_size,), jnp.int32)}
    for i, (name, (field, shape)) in enumerate(eagle3.tensor_specs(dcfg).items()):
        if field and field not in values:
            scale = 1.0 if "norm" in name else shape[-1] ** -0.5
            values[field] = (jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32) * scale).astype(dtype)
    values.update({f: None for f in ("input_norm", "q_b", "k_b", "v_b", "o_b") if f not in values})
    return dcfg, eagle3.DrafterParams(**values)


def eagle3_times(cfg, k: int, batches: list[int], context: int, page_size: int = 16) -> list[dict]:
    """An EAGLE-3 drafter's cost (ms, median) per batch: `propose` after a verify step whose k + 1 rows were all
    accepted (the first pass writes their K/V; then k - 1 draft steps), and one draft step alone (one row, reading
    the context's K/V), each row at `context` positions of its own pages."""
    dcfg, dparams = random_drafter(cfg)
    jax.block_until_ready(dparams)
    out = []
    for B in batches:
        width = -(-(context + 2 * k + 2) // page_size)
        table = np.arange(1, B * width + 1, dtype=np.int32).reshape(B, width)
        pages = eagle3.Pages(jax.device_put(table), jax.device_put(np.zeros(B, np.int32)))
        kv = eagle3.DraftKV.zeros(dcfg, B * width + 1, page_size, jnp.bfloat16)
        rng = np.random.default_rng(0)
        tokens = jax.device_put(rng.integers(0, cfg.vocab_size, (B, k + 1), np.int32))
        positions = jax.device_put(np.tile(np.arange(context, context + k + 1, dtype=np.int32), (B, 1)))
        aux = jnp.asarray(rng.standard_normal((dcfg.num_aux, B, k + 1, cfg.hidden_size)), jnp.float32)
        temperature, keys = jnp.zeros(B), jnp.zeros((B, 2), jnp.uint32)

        @jax.jit
        def propose(dparams, kv, tokens, aux, positions):
            prop = eagle3.propose(dparams, dcfg, kv, tokens, aux, positions, pages, temperature, keys, num_tokens=k)
            return prop.tokens

        @jax.jit
        def one_step(dparams, kv, tokens, hidden, positions):
            return eagle3.step(dparams, dcfg, kv, tokens, hidden, positions, pages, write=False).logits

        hidden = jnp.zeros((B, 1, dcfg.hidden_size), jnp.bfloat16)
        ms_propose = timeit(lambda: propose(dparams, kv, tokens, aux, positions)) * 1e3
        ms_step = timeit(lambda: one_step(dparams, kv, tokens[:, :1], hidden, positions[:, :1])) * 1e3
        out.append(
            {
                "method": "eagle3",
                "k": k,
                "batch": B,
                "context": context,
                "propose_ms": ms_propose,
                "step_ms": ms_step,
                "draft_vocab": dcfg.draft_vocab_size,
                "intermediate": dcfg.intermediate_size,
            }
        )
        print(
            f"[eagle3] k={k} batch {B} context {context}: propose {ms_propose:.3f} ms (first pass of {k + 1} rows + "
            f"{k - 1} steps), one draft step {ms_step:.3f} ms",
            flush=True,
        )
    return out


def run(engine: Engine, prompts: list[list[int]], output_len: int) -> tuple[list[list[int]], float, float]:
    """All prompts at once, greedy -> (outputs, seconds, seconds to the first output token of any request)."""
    sp = SamplingParams(temperature=0, max_tokens=output_len, stop_token_ids=[])
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sp)
    out = {str(i): [] for i in range(len(prompts))}
    first = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            if first is None and o.new_token_ids:
                first = time.perf_counter() - t0
    return [out[str(i)] for i in range(len(prompts))], time.perf_counter() - t0, first


def end_to_end(params, cfg, args, overrides: dict, save) -> list[dict]:
    """Every engine has the same settings (room for the largest concurrency), so all of them compile the same
    programs: the first engine with and without speculation compiles, the others load from the compilation cache.
    Each engine runs `--repeats` jobs, each on new random prompts (no prefix cache hits); a row gives their median
    and every run (a batch-1 job lasts ~0.3 s, and its first token moves by milliseconds between runs)."""
    rows = []
    rng = np.random.default_rng(0)
    max_len = args.input_len + args.output_len
    settings = {
        **overrides,
        "max_num_seqs": max(*args.concurrency, overrides.get("max_num_seqs", 1)),
        "max_model_len": max_len,
        "min_context_bucket": max_len,
        "min_prefill_bucket": min(args.input_len, 512),
        "warmup": True,
    }
    for n in args.concurrency:
        jobs = [
            [rng.integers(0, cfg.vocab_size, args.input_len).tolist() for _ in range(n)] for _ in range(args.repeats)
        ]
        conts, base = [], []
        for length in [None, *args.acceptance_lengths]:
            spec = None
            if length is not None:
                spec = dict(
                    method="oracle",
                    num_speculative_tokens=args.k,
                    acceptance_length=length,
                    continuations=conts,
                    force_acceptance=args.force_acceptance,
                    disable_by_batch_size=args.disable_by_batch_size,
                )
            t0 = time.perf_counter()
            engine = Engine(
                loaded=(cfg, params),
                config=args.config,
                impl=args.impl,
                progress=False,
                speculative_config=spec,
                **settings,
            )
            warm = time.perf_counter() - t0
            runs, same = [], True
            for r, prompts in enumerate(jobs):
                outs, seconds, ttft = run(engine, prompts, args.output_len)
                n_out = sum(map(len, outs))
                runs.append(
                    {"output_tokens": n_out, "seconds": seconds, "output_tok_s": n_out / seconds, "ttft_s": ttft}
                )
                if length is None:
                    conts += [p + o for p, o in zip(prompts, outs)]
                    base.append(outs)
                else:
                    same = same and outs == base[r]
            st = engine.stats()
            row = {
                "concurrency": n,
                "acceptance_length_target": length,
                "k": args.k if length is not None else 0,
                **{key: float(np.median([x[key] for x in runs])) for key in ("output_tok_s", "ttft_s", "seconds")},
                "output_tokens": runs[0]["output_tokens"],
                "runs": runs,
                "warmup_s": warm,
            }
            if length is not None:
                row["acceptance_length"] = 1 + st.spec_decode_num_accepted_tokens / max(st.spec_decode_num_drafts, 1)
                row["identical_to_plain"] = same
                row["forced_acceptance"] = args.force_acceptance
            rows.append(row)
            save(rows)
            acc = ""
            if length is not None:
                acc = f", acceptance length {row['acceptance_length']:.2f}, same tokens: {row['identical_to_plain']}"
            each = ", ".join(f"{x['output_tok_s']:.1f}" for x in runs)
            each = f" (runs: {each})" if len(runs) > 1 else ""
            print(
                f"[e2e] concurrency {n}, {'no speculation' if length is None else f'oracle L={length} k={args.k}'}: "
                f"{row['output_tok_s']:.1f} output tok/s{acc}, first token {row['ttft_s'] * 1e3:.1f} ms{each} "
                f"(warm-up {warm:.1f}s)",
                flush=True,
            )
            engine.close()
            del engine
            gc.collect()
    return rows


def main() -> None:
    runtime.prepare()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-oss-20b")
    ap.add_argument("--smoke", action="store_true", help="tiny model, short jobs: a CPU check of the script")
    ap.add_argument("--ks", default="1,2,3,4,5,6,7", help="draft lengths of the verify-step timing")
    ap.add_argument("--verify-batches", default="1", help="batch sizes of the verify-step timing")
    ap.add_argument("--k", type=int, default=3, help="draft length of the end-to-end runs")
    ap.add_argument("--acceptance-lengths", default="2.5,3.0,3.5")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument(
        "--exact-acceptance",
        dest="force_acceptance",
        action="store_false",
        help="accept drafts only where they equal the target's tokens (default: by the oracle's schedule: on random "
        "bf16 weights near-tied logits make the verify step's argmax differ from a one-token step's, and no "
        "continuation computed beforehand survives)",
    )
    ap.add_argument(
        "--disable-by-batch-size",
        type=int,
        default=None,
        help="speculative_config's: disable speculation when more than N requests are enqueued (running + waiting) "
        "(default: none)",
    )
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1, help="end-to-end jobs per engine, each on new prompts (median)")
    ap.add_argument("--config", default="low_latency", help="engine profile of the end-to-end runs")
    ap.add_argument("--impl", choices=["pallas", "reference"], default=None, help="default: pallas on GPU")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an engine setting over the profile's for the end-to-end runs (VALUE as YAML)",
    )
    ap.add_argument("--skip", action="append", default=[], choices=["verify", "drafter", "e2e"])
    ap.add_argument("--method", choices=["eagle3"], help="time only this drafter's cost (--k, --verify-batches)")
    ap.add_argument("--out", default="speculative.json")
    args = ap.parse_args()
    overrides = {}
    if args.smoke:
        cfg = config.from_hf_dict(SMOKE)
        args.ks, args.verify_batches, args.acceptance_lengths, args.concurrency = "2", "1", "2.5", "1"
        args.k, args.input_len, args.output_len = 2, 24, 12
        overrides = dict(SMOKE_ENGINE, max_num_seqs=2)
    else:
        cfg = config.preset(args.preset)
    overrides.update(parse_setting(item) for item in args.set)
    args.acceptance_lengths = [float(x) for x in args.acceptance_lengths.split(",")]
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    ks = [int(x) for x in args.ks.split(",")]
    batches = [int(x) for x in args.verify_batches.split(",")]
    kernels = resolved(KernelConfig(impl=args.impl or "auto"))
    result = {
        "preset": "smoke" if args.smoke else args.preset,
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "commit": commit_id(),
        "impl": kernels.impl,
        "note": "random weights: acceptance is forced by the oracle drafter, not measured on real text",
    }
    if jax.devices()[0].platform == "gpu":
        result["copy_bandwidth_tb_s"] = copy_bandwidth(warmup=1) / 1e12
        print(f"copy bandwidth {result['copy_bandwidth_tb_s']:.2f} TB/s", flush=True)

    def save(rows=None, key="e2e"):
        if rows is not None:
            result[key] = rows
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))

    if "drafter" not in args.skip or args.method == "eagle3":
        save(eagle3_times(cfg, args.k, batches, args.input_len), "eagle3")
    if args.method == "eagle3":  # the drafter alone: no target weights
        return
    params = random_params(cfg, kernels)
    jax.block_until_ready(params)
    if "verify" not in args.skip:
        save(verify_times(params, cfg, kernels, ks, batches, args.input_len), "verify")
    if "drafter" not in args.skip:
        save(drafter_times(cfg, args.k, max(batches), args.input_len), "drafter")
    if "e2e" not in args.skip:
        end_to_end(params, cfg, args, overrides, save)
    save()


if __name__ == "__main__":
    main()
