"""What one rank of a sharded mesh computes, timed on one GPU: the inputs of `tools.project_scaling`.

    python -m tools.measure_rank_shapes --out docs/results/rank_shapes_h200.json     # one H200, < 8 min
    python -m tools.measure_rank_shapes --smoke --out /tmp/rank_shapes.json          # CPU, tiny model
    python -m tools.measure_rank_shapes --models gpt-oss-120b --devices 2,4 --out rank_shapes_2_4_h200.json

A rank of `(model, mode, n)` (n devices on the `model` axis, `sharding/rules.py`) holds `E_pad / n` experts and,
in low_latency, `1/n` of the heads and of the vocabulary (max_throughput: all heads, the whole vocabulary). The
tool builds that rank's model on one device (random weights: `tools.common.random_params`) and times:

* `decode`: the engine's decode step (`steps.decode` via `tools.common.decode_step`, one token per row, greedy
  sampling) of the rank's config with 2 and 4 layers: per layer pair = t4 - t2, fixed part (embedding, unembedding,
  sampling) = 2 t2 - t4, at each batch; the projection scales to the real layer count. Batch = rows per attention
  rank.
* `prefill`: one `--prefill-tokens` chunk per rank at two starts (2 layers).
* `moe`: the rank's config routes each token to `min(k, E/n)` of its local experts, which is not what the rank
  gets on a mesh, so the MoE is also timed alone (per layer, all 4 layers' experts, different routing each): as
  the single-device step runs it (`pallas_kernels.moe_block`, kind `emulated`) and as the sharded step runs it
  (`pallas_kernels.experts` on the rows the dispatch delivers, uniform routing, `sharding.expert_parallel`'s
  masking; kinds `low_latency` (the group's tokens, pairs of other devices masked), `all_gather` (n x the rank's
  tokens, masked), `all_to_all` (the receive buffer `a2a_dispatch.capacity` rows, the first T x k valid)).
  The projection uses `decode - layers x (emulated - kind)`.

Copy bandwidth and bf16 matmul rate are measured in the same run. Shapes come in priority order and the JSON is
rewritten after each config, so a run cut short by `--budget-s` (default 400 s after the ceilings) keeps what it
measured; the rest is listed under `skipped`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from gptoss_jax import config as config_lib
from gptoss_jax import runtime
from gptoss_jax.random_weights import DEMO_CONFIG
from pallas_kernels import REFERENCE, KernelConfig
from sharding import a2a_dispatch, expert_parallel
from tools import common

# (model, mode, n, decode batches per rank, prefill?) in the order they are measured: one GPU, the ranks of 72 GPUs
# (9 x 8: the n = 8 ones; 1 x 72: EP72), the 2- and 4-GPU shapes of the measured runs (BENCHMARKS.md section 6), 20b.
CONFIGS = (
    ("gpt-oss-120b", "low_latency", 1, (1, 64, 256), True),
    ("gpt-oss-120b", "max_throughput", 8, (1, 64, 256), True),
    ("gpt-oss-120b", "max_throughput", 72, (1, 64, 256), True),
    ("gpt-oss-120b", "low_latency", 8, (1, 64), True),
    ("gpt-oss-120b", "max_throughput", 4, (1, 64, 256), False),
    ("gpt-oss-120b", "max_throughput", 2, (1, 64, 256), False),
    ("gpt-oss-120b", "low_latency", 4, (1, 64), False),
    ("gpt-oss-120b", "low_latency", 2, (1, 64), False),
    ("gpt-oss-20b", "low_latency", 1, (1, 64, 256), True),
    ("gpt-oss-20b", "max_throughput", 8, (1, 64, 256), True),
    ("gpt-oss-20b", "low_latency", 8, (1, 64), True),
)
CONTEXTS = (1024, 8192)  # decode: every batch at the first, batch 64 also at the second
PREFILL_STARTS = (0, 6144)
SMOKE = dict(
    num_hidden_layers=4,
    num_local_experts=8,
    num_experts_per_tok=4,
    experts_per_token=4,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=64,
    head_dim=16,
    num_attention_heads=8,
    num_key_value_heads=4,
    sliding_window=8,
)
SMOKE_CONFIGS = (("smoke", "max_throughput", 4, (4,), True),)


def rank_config(cfg: config_lib.ModelConfig, mode: str, n: int, layers: int) -> tuple[config_lib.ModelConfig, dict]:
    """The model one rank holds, as a config one device runs, and what it is a share of."""
    tp = n if mode == "low_latency" and cfg.num_kv_heads % n == 0 else 1  # `Layout.rules`: whole GQA groups only
    vocab = cfg.vocab_size // n if mode == "low_latency" and cfg.vocab_size % n == 0 else cfg.vocab_size
    padded = expert_parallel.padded_count(cfg.num_experts, n)
    local = padded // n
    rank = dataclasses.replace(
        cfg,
        num_layers=layers,
        num_heads=cfg.num_heads // tp,
        num_kv_heads=cfg.num_kv_heads // tp,
        vocab_size=vocab,
        num_experts=local,
        experts_per_token=min(cfg.experts_per_token, local),
    )
    info = dict(
        heads=rank.num_heads, kv_heads=rank.num_kv_heads, vocab=vocab, experts_local=local, experts_padded=padded
    )
    return rank, info


def dispatch_rows(cfg, mode: str, n: int, kind: str, T: int, rng: np.random.Generator):
    """Rows, local expert ids, weights and validity `[rows, k]` that the MoE kernels of rank 0 get on the mesh for
    `T` tokens per attention rank under uniform routing (`kind`: emulated routing is not built here)."""
    E, k, local = cfg.num_experts, cfg.experts_per_token, expert_parallel.padded_count(cfg.num_experts, n) // n
    if kind == "all_to_all":  # one pair per row; T x k pairs arrive on average (all ranks send T x k, n ways)
        rows = a2a_dispatch.capacity(T, k, local, n)
        arrived = min(T * k, rows)
        ids = np.zeros((rows, 1), np.int32)
        ids[:arrived, 0] = rng.integers(0, min(local, E), arrived)
        valid = np.arange(rows)[:, None] < arrived
        return rows, ids, valid.astype(np.float32), valid
    rows = T * (n if kind == "all_gather" else 1)  # all-gather: every rank's tokens; low latency: the group's
    idx = np.argpartition(rng.random((rows, E)), k - 1, axis=1)[:, :k].astype(np.int32)  # uniform, k distinct of E
    mine = idx < local  # rank 0 owns experts [0, local)
    fill = np.where(mine.any(axis=1, keepdims=True), idx, 0)
    return rows, np.where(mine, fill, 0), np.where(mine, 1.0 / k, 0.0).astype(np.float32), mine


def time_moe(cfg, rank_cfg, params, kernels, kind: str, T: int, mode: str, n: int, dtype, timing) -> dict:
    """Seconds per layer of the MoE over all the stacked layers of `params` (different routing per layer). Every
    array goes in as an argument: one a jitted function closed over would be baked into the program as a constant
    (gigabytes of experts: minutes of compiling)."""
    L, D = rank_cfg.num_layers, cfg.hidden_size
    rng = np.random.default_rng(T * 1000 + n)
    kw = dict(swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha, kernels=kernels)
    if kind == "emulated":  # what the rank config's single-device step runs
        x = jax.random.normal(jax.random.PRNGKey(1), (T, D), jnp.float32)

        def emulated(x, lp, final_norm):
            def body(layer, x):
                x, _ = pallas_kernels.moe_block(
                    x,
                    lp.mlp_norm,
                    lp.router_w,
                    lp.router_b,
                    lp.experts,
                    layer,
                    (lp.attn_norm, final_norm),
                    eps=cfg.rms_norm_eps,
                    dtype=dtype,
                    top_k=rank_cfg.experts_per_token,
                    **kw,
                )
                return x

            return jax.lax.fori_loop(0, L, body, x)

        fn = jax.jit(emulated)
        t = common.timeit(lambda: fn(x, params.layers, params.final_norm), **timing)
        return dict(kind=kind, tokens=T, rows=T, valid_pairs=T * rank_cfg.experts_per_token, ms_per_layer=t / L * 1e3)
    built = [dispatch_rows(cfg, mode, n, kind, T, rng) for _ in range(L)]
    rows = built[0][0]
    ids, ws, valid = (jnp.asarray(np.stack([b[i] for b in built])) for i in (1, 2, 3))
    x = (0.5 * jax.random.normal(jax.random.PRNGKey(2), (rows, D), jnp.float32)).astype(dtype)

    def dispatched(x, ids, ws, valid, experts):
        def body(layer, acc):
            y = pallas_kernels.experts(x, ids[layer], ws[layer], experts, layer, valid[layer], **kw)
            return acc + y[0, 0]

        return jax.lax.fori_loop(0, L, body, jnp.float32(0))

    fn = jax.jit(dispatched)
    t = common.timeit(lambda: fn(x, ids, ws, valid, params.layers.experts), **timing)
    return dict(kind=kind, tokens=T, rows=rows, valid_pairs=int(valid.sum()) // L, ms_per_layer=t / L * 1e3)


def measure_config(name, cfg, mode, n, batches, prefill, args, kernels, dtype, timing, deadline) -> dict:
    out = dict(model=name, mode=mode, n=n, layers_full=cfg.num_layers, decode=[], prefill=[], moe=[], skipped=[])
    made = {}
    try:
        for layers in (2, 4):
            rank_cfg, out["rank"] = rank_config(cfg, mode, n, layers)
            made[layers] = (rank_cfg, common.random_params(rank_cfg, kernels, dtype))
    except Exception as e:  # noqa: BLE001  e.g. out of memory: the other configs still run
        out["failed"] = [dict(what="weights", error=f"{type(e).__name__}: {e}"[:300])]
        print(f"  {name} {mode} n={n}: weights FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        return out
    jobs = [("decode", layers, b, args.contexts[0]) for b in batches for layers in (2, 4)]  # fixed part per batch
    jobs += [("decode", 2, 64 if 64 in batches else batches[-1], c) for c in args.contexts[1:]]
    moe_kinds = ("emulated",) if n == 1 else ("emulated", mode if mode == "low_latency" else "all_gather")
    moe_kinds += ("all_to_all",) if mode == "max_throughput" and n > 1 else ()
    jobs += [("moe", kind, b, None) for b in batches for kind in moe_kinds]
    if prefill:
        jobs += [("prefill", 2, args.prefill_tokens, s) for s in args.prefill_starts]
        jobs += [("moe", kind, args.prefill_tokens, "prefill") for kind in moe_kinds]
    for what, a, b, c in jobs:
        if time.perf_counter() > deadline:
            out["skipped"].append(dict(what=what, arg=a, tokens=b, at=c))
            continue
        t0 = time.perf_counter()
        try:
            line = _run_job(out, made, cfg, mode, n, what, a, b, c, kernels, dtype, timing)
        except Exception as e:  # noqa: BLE001  one shape failing (memory, a kernel's limits) must not end the run
            out.setdefault("failed", []).append(
                dict(what=what, arg=a, tokens=b, at=c, error=f"{type(e).__name__}: {e}"[:300])
            )
            line = f"{what} {a} {b} {c}: FAILED {type(e).__name__}: {str(e)[:200]}"
        print(f"  {name} {mode} n={n}: {line}  [{time.perf_counter() - t0:.1f} s]", flush=True)
    del made
    return out


def _run_job(out, made, cfg, mode, n, what, a, b, c, kernels, dtype, timing) -> str:
    """One measurement appended to `out`; -> the line to print."""
    if what == "decode":
        rank_cfg, params = made[a]
        step = common.decode_step(params, rank_cfg, b, c - 1, kernels, num_top=1)
        ms = common.timeit(lambda: step(block=False), **timing) * 1e3
        step.free()
        out["decode"].append(dict(layers=a, batch=b, context=c, ms=ms))
        line = f"decode {a} layers batch {b} context {c}: {ms:.3f} ms"
    elif what == "prefill":
        rank_cfg, params = made[a]
        step = common.prefill_step(params, rank_cfg, 1, b, kernels, start=c, num_top=1)
        ms = common.timeit(lambda: step(block=False), **timing) * 1e3
        step.free()
        out["prefill"].append(dict(layers=a, tokens=b, start=c, ms=ms))
        line = f"prefill {a} layers {b} tokens at {c}: {ms:.3f} ms"
    else:
        rank_cfg, params = made[4]
        r = time_moe(cfg, rank_cfg, params, kernels, a, b, mode, n, dtype, timing)
        r["step"] = c or "decode"
        out["moe"].append(r)
        line = f"moe {r['step']} {a} {b} tokens ({r['rows']} rows, {r['valid_pairs']} pairs): "
        line += f"{r['ms_per_layer']:.3f} ms/layer"
    return line


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write (rewritten after each config)")
    ap.add_argument("--models", default="gpt-oss-120b,gpt-oss-20b", help="which models' configs to measure")
    ap.add_argument("--devices", default=None, help="only the rank configs of these device counts, e.g. 2,4")
    ap.add_argument("--budget-s", type=float, default=400.0, help="start no measurement after this many seconds")
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--smoke", action="store_true", help="CPU check: a tiny model, the reference path, tiny shapes")
    args = ap.parse_args(argv)
    if args.smoke:
        if not jax.config.jax_platforms:
            jax.config.update("jax_platforms", "cpu")
        configs, timing = SMOKE_CONFIGS, dict(warmup=1, reps=1, calls=1)
        base = config_lib.from_hf_dict(dict(DEMO_CONFIG, **SMOKE))
        models = {"smoke": base}
        kernels, dtype = REFERENCE, jnp.float32
        args.contexts, args.prefill_starts, args.prefill_tokens = (32, 64), (0, 16), 16
        ceilings = dict(
            copy_Bps=common.copy_bandwidth(1 << 20, **timing), matmul_flops=common.matmul_rate(64, **timing)
        )
    else:
        runtime.prepare()
        wanted = set(args.models.split(","))
        devices = {int(x) for x in args.devices.split(",")} if args.devices else None
        configs = tuple(c for c in CONFIGS if c[0] in wanted and (devices is None or c[2] in devices))
        models = {m: common.model_config(m) for m in wanted}
        timing = dict(warmup=1, reps=5, calls=3)
        kernels, dtype = common.resolved(KernelConfig()), jnp.bfloat16
        args.contexts, args.prefill_starts = CONTEXTS, PREFILL_STARTS
        ceilings = dict(
            copy_Bps=common.copy_bandwidth(2 << 30, warmup=1, reps=5, calls=10),
            matmul_flops=common.matmul_rate(8192, warmup=1, reps=5, calls=10),
        )
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    result = dict(
        device=str(jax.devices()[0].device_kind),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        commit=os.environ.get("GPTOSS_JAX_COMMIT", "unknown (set GPTOSS_JAX_COMMIT)"),
        kernels=kernels.impl,
        smoke=args.smoke,
        ceilings=ceilings,
        budget_s=args.budget_s,
        configs=[],
    )
    print(
        f"{result['device']}: copy {ceilings['copy_Bps'] / 1e12:.2f} TB/s, bf16 matmul "
        f"{ceilings['matmul_flops'] / 1e12:.0f} TFLOP/s",
        flush=True,
    )
    for name, mode, n, batches, prefill in configs:
        if time.perf_counter() > deadline:
            result["configs"].append(dict(model=name, mode=mode, n=n, skipped="budget"))
            continue
        result["configs"].append(
            measure_config(name, models[name], mode, n, batches, prefill, args, kernels, dtype, timing, deadline)
        )
        result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out} ({result['elapsed_s']} s)", flush=True)


if __name__ == "__main__":
    main()
