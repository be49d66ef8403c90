"""Command line generation: `python -m gptoss_jax.generate --model DIR|ORG/NAME --prompt TEXT`.

Without `--model` it runs the built-in demo checkpoint; model and engine flags are `serve`'s (vLLM's names).
`--input in.jsonl --output out.jsonl` runs a resumable offline batch job instead (see `gptoss_jax.batch`).
"""

import argparse
import json
import sys
import time

from gptoss_jax import batch, cli
from gptoss_jax.engine import Engine
from gptoss_jax.llm import LLM
from gptoss_jax.sampling import SamplingParams
from sharding import distributed


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=cli.prog("gptoss-generate", "gptoss_jax.generate"),
        description=__doc__.splitlines()[0],
        formatter_class=cli.Formatter,
    )
    cli.add_model_args(p)
    cli.add_engine_args(p)
    g = p.add_argument_group("input and output")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenised as is, special tokens allowed)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids, e.g. 1,2,3")
    src.add_argument("--input", help="JSONL of requests for a batch job (needs --output)")
    g.add_argument("--output", help="JSONL results of a batch job; ids already there are skipped (resume)")
    g.add_argument(
        "--output-order",
        choices=["completion", "input"],
        default="completion",
        help="batch jobs: write each result as it finishes, or in the input's order",
    )
    g.add_argument("--cache-dir", help="save/restore converted parameters here (orbax)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    s = p.add_argument_group("sampling (a batch job's lines may set their own)")
    s.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    s.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    s.add_argument("--top-k", type=int, default=0, help="sample among the k most likely (0 = off)")
    s.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability (0 = off)")
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
        sp = SamplingParams(**_sampling(args))
        model_path, ec = cli.resolve(args)
        t0 = time.perf_counter()
        llm = LLM(
            model_path,
            dtype=args.dtype,
            tokenizer=args.tokenizer,
            cache_dir=args.cache_dir,
            compile_cache_dir=args.compile_cache_dir,
            impl=args.impl,
            seed=args.seed or 0,
            progress=not args.json,
            engine_config=ec,
        )
        t1 = time.perf_counter()
        if ids is not None:
            out = llm.generate(prompt_token_ids=[ids], sampling_params=sp, use_tqdm=not args.json)[0]
        else:
            out = llm.generate([args.prompt], sp, use_tqdm=not args.json)[0]
        t2 = time.perf_counter()
    except (ValueError, OSError, RuntimeError) as e:
        return cli.fail(e)
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


def _sampling(args) -> dict:
    return dict(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, max_tokens=args.max_tokens
    )


def _batch(args) -> int:
    try:
        SamplingParams(**_sampling(args))
        batch.read_lines(args.input)  # a missing file or duplicate ids fail before the model loads
        model_path, ec = cli.resolve(args)
        engine = Engine(
            model_path,
            dtype=args.dtype,
            config=ec,
            tokenizer=args.tokenizer,
            cache_dir=args.cache_dir,
            compile_cache_dir=args.compile_cache_dir,
            impl=args.impl,
            seed=args.seed or 0,
        )
        summary = batch.run(engine, args.input, args.output, _sampling(args), ordered=args.output_order == "input")
    except (ValueError, OSError, RuntimeError) as e:
        return cli.fail(e)
    print(json.dumps(summary))
    if summary["failed"]:
        print(f"error: {summary['failed']} request(s) failed (logged above); rerun to retry them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
