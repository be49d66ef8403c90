"""Command line generation: `python -m gptoss_jax.generate --model DIR --prompt TEXT`.

Without `--model` it runs the built-in demo checkpoint. `--input in.jsonl --output out.jsonl` runs a
resumable offline batch job instead (see `gptoss_jax.batch`).
"""

import argparse
import json
import sys
import time

from gptoss_jax import batch
from gptoss_jax.engine import Engine
from gptoss_jax.llm import LLM
from gptoss_jax.sampling import SamplingParams
from pallas_kernels.kv_quant import DTYPES as KV_CACHE_DTYPES
from sharding import distributed


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gptoss_jax.generate", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint folder (HF or original layout); default: built-in demo")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenised as is, special tokens allowed)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids, e.g. 1,2,3")
    src.add_argument("--input", help="JSONL of requests for a batch job (needs --output)")
    p.add_argument("--output", help="JSONL results of a batch job; existing ids are skipped (resume)")
    p.add_argument("--engine-config", help="engine profile (low_latency, max_throughput) or YAML file")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument(
        "--kv-cache-dtype",
        choices=sorted(KV_CACHE_DTYPES),
        default=None,
        help="KV cache: 'auto' (the model's dtype) or 'fp8' (e4m3, half the bytes; default: the config's, auto)",
    )
    p.add_argument("--tokenizer", help="path to o200k_base.tiktoken (or its folder)")
    p.add_argument("--cache-dir", help="save/restore converted parameters here (orbax)")
    p.add_argument("--compile-cache-dir", help="where compiled steps persist across runs ('off' for none)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    distributed.initialize()  # joins a multi-host job when GPTOSS_COORDINATOR etc. are set; else a no-op
    if (args.input is None) != (args.output is None):
        print("error: --input and --output go together", file=sys.stderr)
        return 2
    if args.input is not None:
        return _batch(args)
    ids = None
    if args.prompt_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            print(f"error: --prompt-ids must be comma-separated integers, got {args.prompt_ids!r}", file=sys.stderr)
            return 2
    try:
        sp = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=args.seed,
            max_tokens=args.max_tokens,
        )
        t0 = time.perf_counter()
        llm = LLM(
            args.model,
            dtype=args.dtype,
            tokenizer=args.tokenizer,
            cache_dir=args.cache_dir,
            compile_cache_dir=args.compile_cache_dir,
            progress=not args.json,
            engine_config=args.engine_config,
            **_cache_overrides(args),
        )
        t1 = time.perf_counter()
        if ids is not None:
            out = llm.generate(prompt_token_ids=[ids], sampling_params=sp, use_tqdm=not args.json)[0]
        else:
            out = llm.generate([args.prompt], sp, use_tqdm=not args.json)[0]
        t2 = time.perf_counter()
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    c = out.outputs[0]
    if args.json:
        print(
            json.dumps(
                {
                    "model": str(llm.model_path),
                    "prompt_token_ids": out.prompt_token_ids,
                    "token_ids": c.token_ids,
                    "text": c.text,
                    "finish_reason": c.finish_reason,
                    "load_s": round(t1 - t0, 3),
                    "generate_s": round(t2 - t1, 3),
                }
            )
        )
    else:
        print(c.text if c.text is not None else " ".join(map(str, c.token_ids)))
        print(
            f"[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}, load {t1 - t0:.1f}s, "
            f"generate {t2 - t1:.1f}s]",
            file=sys.stderr,
        )
    return 0


def _cache_overrides(args) -> dict:
    """Engine settings given as flags (over the engine config's)."""
    return {"kv_cache_dtype": args.kv_cache_dtype} if args.kv_cache_dtype else {}


def _batch(args) -> int:
    defaults = dict(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )
    try:
        engine = Engine(
            args.model,
            dtype=args.dtype,
            config=args.engine_config,
            tokenizer=args.tokenizer,
            cache_dir=args.cache_dir,
            compile_cache_dir=args.compile_cache_dir,
            **_cache_overrides(args),
        )
        summary = batch.run(engine, args.input, args.output, defaults)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    if summary["failed"]:
        print(f"error: {summary['failed']} request(s) failed (logged above); rerun to retry them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
