"""Accuracy of the FP8 KV cache on a full-width slice of a real model shape (random weights drawn on device): prompt
logits and greedy continuations with `kv_cache_dtype: fp8` against the model-dtype cache, beside bf16's own error
against fp32. Every engine runs the kernels the device picks, as serving does.

    python -m tools.check_kv_cache --preset gpt-oss-20b --layers 4 --prompt-len 4096 --new-tokens 64 --out kv.json
    python -m tools.check_kv_cache --smoke          # tiny model, CPU check of the script
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import numpy as np

from gptoss_jax import config, runtime
from gptoss_jax.engine import DTYPES, Engine
from gptoss_jax.sampling import SamplingParams
from pallas_kernels import KernelConfig
from tools.bench_throughput import SMOKE
from tools.common import random_params, resolved

RUNS = (("float32", "auto"), ("float32", "fp8"), ("bfloat16", "auto"), ("bfloat16", "fp8"))


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def run(cfg, dtype: str, kv: str, prompt: list[int], new_tokens: int, seed: int) -> dict:
    """One engine: the prompt's logits `[len, vocab]` and its greedy continuation."""
    params = random_params(cfg, resolved(KernelConfig()), DTYPES[dtype], seed=seed)  # bf16: fp32's, rounded
    engine = Engine(
        loaded=(cfg, params),
        dtype=dtype,
        kv_cache_dtype=kv,
        max_model_len=len(prompt) + new_tokens,
        kv_cache_tokens=2 * (len(prompt) + new_tokens),
        prefill_chunk_size=min(2048, len(prompt)),
        progress=False,
    )
    logits = engine.prompt_logits(prompt)
    engine.add_request("0", prompt, SamplingParams(temperature=0, max_tokens=new_tokens, stop_token_ids=[]))
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    engine.close()
    return {"logits": logits, "tokens": tokens}


def main() -> None:
    runtime.prepare()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-oss-20b")
    ap.add_argument("--layers", type=int, default=4, help="the slice: this many layers at full width")
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny model, short prompt: a CPU check of the script")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.smoke:
        cfg = config.from_hf_dict(SMOKE)
        args.prompt_len, args.new_tokens = 40, 8
    else:
        cfg = dataclasses.replace(config.preset(args.preset), num_layers=args.layers)
    prompt = np.random.default_rng(args.seed).integers(0, cfg.vocab_size, args.prompt_len).tolist()
    res = {}
    for dtype, kv in RUNS:
        t0 = time.perf_counter()
        res[dtype, kv] = run(cfg, dtype, kv, prompt, args.new_tokens, args.seed)
        print(f"{dtype} model, kv {kv}: {time.perf_counter() - t0:.1f} s", flush=True)
    truth = res["float32", "auto"]
    rows = []
    for dtype, kv in RUNS[1:]:
        r = res[dtype, kv]
        same = [a == b for a, b in zip(r["tokens"], truth["tokens"])]
        rows.append(
            {
                "model_dtype": dtype,
                "kv_cache_dtype": kv,
                "logits_rel_err_vs_fp32": _rel(r["logits"], truth["logits"]),
                "logits_rel_err_vs_same_dtype_auto": _rel(r["logits"], res[dtype, "auto"]["logits"]),
                "greedy_agreement_vs_fp32": float(np.mean(same)),
                "greedy_first_divergence": same.index(False) if False in same else len(same),
                "argmax_agreement_vs_fp32": float(np.mean(r["logits"].argmax(-1) == truth["logits"].argmax(-1))),
            }
        )
        print(
            f"{dtype} model, kv {kv}: logits rel err {rows[-1]['logits_rel_err_vs_fp32']:.2e} vs fp32 "
            f"({rows[-1]['logits_rel_err_vs_same_dtype_auto']:.2e} vs its own dtype's cache), prompt argmax "
            f"agreement {rows[-1]['argmax_agreement_vs_fp32']:.4f}, greedy {rows[-1]['greedy_agreement_vs_fp32']:.3f} "
            f"(first divergence at {rows[-1]['greedy_first_divergence']} of {args.new_tokens})",
            flush=True,
        )
    result = {
        "preset": "smoke" if args.smoke else args.preset,
        "layers": cfg.num_layers,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "device": jax.devices()[0].device_kind,
        "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
