"""Command-line flags `serve` and `generate` share, named as vLLM names them.

Each engine flag overrides the same key of the engine profile (`--config`, a YAML file or profile name); flags left
out keep the profile's value. docs/server.md has the table vLLM flag -> ours.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pallas_kernels.kv_quant import DTYPES as KV_CACHE_DTYPES

# flag dest -> EngineConfig field
ENGINE_FLAGS = {
    "max_model_len": "max_model_len",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "tensor_parallel_size": "model_parallel",
    "data_parallel_size": "replicas",
    "enable_prefix_caching": "enable_prefix_caching",
    "kv_cache_dtype": "kv_cache_dtype",
    "speculative_config": "speculative_config",
    "compile_workers": "compile_workers",
}


class Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows every default; a help text that names its default itself (the profile's value, an environment
    variable, which must not be printed: an API key) is left as it is."""

    def _get_help_string(self, action):
        if action.default is None or action.default is argparse.SUPPRESS or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def prog(script: str, module: str) -> str:
    """The program's name as it was started: the console script (`gptoss-serve`) or `python -m MODULE`."""
    return script if Path(sys.argv[0]).name == script else f"python -m {module}"


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        help="checkpoint folder (Hugging Face or original layout) or a Hugging Face repo id such as "
        "openai/gpt-oss-20b (downloaded into the hub cache; HF_HUB_OFFLINE=1 uses the cache alone); "
        "default: the built-in demo checkpoint",
    )
    g.add_argument("--revision", help="branch, tag or commit of a Hugging Face repo id (default: main)")
    g.add_argument("--download-dir", help="hub cache folder for repo ids (default: huggingface_hub's, $HF_HUB_CACHE)")
    g.add_argument("--tokenizer", help="path to o200k_base.tiktoken (or its folder); default: looked up (README)")
    g.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="weights and activations")
    g.add_argument(
        "--config",
        "--engine-config",
        dest="config",
        help="engine profile: low_latency, max_throughput or a YAML file (configs/*.yaml); the flags below "
        "override its keys (default: built-in defaults)",
    )


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (each overrides the profile's key; default: the profile's value)")
    g.add_argument("--max-model-len", type=int, help="context limit in tokens (max_model_len)")
    g.add_argument("--max-num-seqs", type=int, help="sequences in the running batch (max_num_seqs)")
    g.add_argument(
        "--max-num-batched-tokens", type=int, help="tokens of a prefill call, padding included (max_num_batched_tokens)"
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="fraction of each GPU's whole memory for weights, KV cache and activations, as vLLM's "
        "(gpu_memory_utilization; the profiles' 0.9)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        help="GPUs on the model axis (model_parallel): attention heads split under low_latency, each GPU its own "
        "sequences under max_throughput; experts split in both",
    )
    g.add_argument("--data-parallel-size", "-dp", type=int, help="independent model replicas (replicas)")
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the KV pages of shared prompt prefixes (enable_prefix_caching)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        choices=sorted(KV_CACHE_DTYPES),
        help="KV cache: 'auto' (the model's dtype) or 'fp8' (e4m3 with a scale per token and KV head: half the "
        "bytes, about twice the pages) (kv_cache_dtype)",
    )
    g.add_argument(
        "--speculative-config",
        metavar="JSON",
        help='speculative decoding, as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": 3, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' or \'{"method": "eagle3", "model": DRAFTER_DIR_OR_HF_ID, '
        '"num_speculative_tokens": 3}\', either with "disable_by_batch_size": N to disable speculation when more '
        "than N requests are enqueued, running + waiting (docs/engine.md; speculative_config)",
    )
    g.add_argument("--seed", type=int, help="seed of the engine's generator for requests without a seed (default: 0)")
    g.add_argument(
        "--compile-cache-dir",
        help="where compiled steps persist across restarts ('off' for none; default $GPTOSS_JAX_COMPILE_CACHE, "
        "else $GPTOSS_JAX_HOME/compile-cache, $GPTOSS_JAX_HOME defaulting to ~/.cache/gptoss_jax)",
    )
    g.add_argument(
        "--compile-workers",
        type=int,
        help="processes that lower warm-up's programs in parallel (0: lower in the server's process; default: one "
        "per two cores up to 8 on a GPU, none elsewhere) (compile_workers)",
    )
    g.add_argument(
        "--impl",
        choices=["pallas", "reference"],
        help="kernels or the pure-JAX reference path (default: kernels on GPU, reference elsewhere)",
    )


def engine_overrides(args: argparse.Namespace) -> dict:
    """The engine flags given on the command line, as `EngineConfig` keys."""
    return {field: getattr(args, dest) for dest, field in ENGINE_FLAGS.items() if getattr(args, dest) is not None}


def resolve(args: argparse.Namespace):
    """Check what can fail before any device work, each failure one line: the model folder (a repo id resolved,
    downloading if needed), its config.json and the engine profile with the flags over it.
    -> (model folder, `EngineConfig`)."""
    from gptoss_jax import checkpoint, demo, engine_config
    from gptoss_jax.config import load_config

    path = (
        checkpoint.resolve_model(args.model, revision=args.revision, download_dir=args.download_dir)
        if args.model
        else demo.checkpoint_path()
    )
    load_config(path)
    checkpoint.find_files(path)
    ec = engine_config.load(args.config, **engine_overrides(args))
    return path, ec


def fail(e: BaseException) -> int:
    """One line on stderr, no traceback, for the errors a user can fix (paths, keys, values)."""
    print(f"error: {e}", file=sys.stderr)
    return 1
