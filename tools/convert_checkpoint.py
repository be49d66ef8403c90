"""Convert a safetensors checkpoint to an orbax checkpoint of `Params`, so later starts skip conversion.

    python -m tools.convert_checkpoint --model /models/gpt-oss-20b --cache-dir /models/converted

Afterwards `LLM(model, cache_dir=...)` and `--cache-dir` restore the converted parameters directly.
The cache key covers the source files (names, sizes, mtimes), the dtype and the expert layout
(`--impl`, default: what this machine's engine uses), so a changed checkpoint is converted again
rather than restored stale.
"""

import argparse
import time
from pathlib import Path

import jax.numpy as jnp

from gptoss_jax import checkpoint, runtime
from pallas_kernels import IMPLS, KernelConfig


def main(argv=None) -> None:
    runtime.prepare()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument(
        "--impl", choices=IMPLS, default=None, help="expert layout (default: what this machine's engine runs)"
    )
    args = ap.parse_args(argv)
    args.impl = args.impl or KernelConfig().for_device().impl
    t0 = time.perf_counter()
    dtype = jnp.dtype(args.dtype)
    checkpoint.load(args.model, dtype, impl=args.impl, cache_dir=args.cache_dir)
    key = checkpoint.fingerprint(Path(args.model), dtype, args.impl)
    target = Path(args.cache_dir).resolve() / f"{Path(args.model).name}-{key}"
    print(f"{target} ready in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
