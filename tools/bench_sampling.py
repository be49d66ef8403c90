"""Sampling cost per decode step: `sampling.sample` on `[batch, 201,088]` logits for each kind of request
(greedy, temperature only, top-p, top-k, min-p), and the pieces it is made of or was made of (the top-k
and top-p thresholds by radix select at 1, 2 and 4 bits a pass, the 1,024-candidate top-k they replaced,
a full-vocabulary cumulative sum, a full sort), against the copy bandwidth measured in the same run.

At batch 256 the logits are 206 MB of fp32: a pass over them is ~0.1 ms at the copy bandwidth, so
anything much slower than a few passes is the sampler, not the memory.

    python -m tools.bench_sampling --batches 1,64,256 --out $OUT/sampling.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from gptoss_jax import runtime, sampling
from tools.common import copy_bandwidth, timeit

VOCAB = 201_088
KINDS = {  # temperature, top_k, top_p, min_p
    "greedy": (0.0, 0, 1.0, 0.0),
    "temperature": (1.0, 0, 1.0, 0.0),
    "top_p 0.9": (1.0, 0, 0.9, 0.0),
    "top_k 50": (1.0, 50, 1.0, 0.0),
    "min_p 0.05": (1.0, 0, 1.0, 0.05),
}


def _radix_piece(bits: int, top_p: bool):
    """The top-k 50 or top-p 0.9 threshold search alone (keys included; for top-p, the softmax)."""

    def f(x):
        target = jnp.full((x.shape[0],), 0.9) if top_p else jnp.full((x.shape[0],), 50, jnp.int32)
        w = jax.nn.softmax(x, axis=-1) if top_p else None
        return sampling._radix_select(sampling._order_keys(x), w, target, bits)

    return f


PIECES = {
    **{
        f"{which} threshold, radix {bits} bit": _radix_piece(bits, which == "top_p")
        for which in ("top_k", "top_p")
        for bits in (1, 2, 4)
    },
    "top_k 1024": lambda x: jax.lax.top_k(x, 1024)[0],  # the candidates the radix select replaced
    "logprobs top 20, argmax passes": lambda x: sampling.top_k(x, 20)[0],  # what the engine runs
    "logprobs top 20, lax.top_k": lambda x: jax.lax.top_k(x, 20)[0],  # what it replaced
    "cumsum": lambda x: jnp.cumsum(x, axis=-1),
    "sort": lambda x: jnp.sort(x, axis=-1),
    "max": lambda x: jnp.max(x, axis=-1),
}


def main() -> None:
    runtime.prepare()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--out", default="sampling.json")
    args = ap.parse_args()
    result = {
        "device": jax.devices()[0].device_kind,
        "vocab": VOCAB,
        "copy_TBps": copy_bandwidth(warmup=1) / 1e12,
        "measurements": [],
    }
    print(f"copy bandwidth {result['copy_TBps']:.2f} TB/s", flush=True)
    sample = jax.jit(sampling.sample)
    for B in (int(b) for b in args.batches.split(",")):
        # Peaked like a language model's logits: a few tokens carry most of the mass.
        logits = 4.0 * jax.random.normal(jax.random.PRNGKey(B), (B, VOCAB), jnp.float32)
        keys = jax.random.bits(jax.random.PRNGKey(1), (B, 2), jnp.uint32)
        one_pass_ms = 2 * logits.nbytes / (result["copy_TBps"] * 1e12) * 1e3
        for kind, (t, k, p, m) in KINDS.items():
            full = lambda v, dt=jnp.float32: jnp.full((B,), v, dt)  # noqa: E731
            argv = (logits, keys, full(t), full(k, jnp.int32), full(p), full(m))
            ms = 1e3 * timeit(lambda: sample(*argv), warmup=2, reps=20)
            result["measurements"].append({"batch": B, "what": f"sample, {kind}", "ms": ms, "passes": ms / one_pass_ms})
            print(f"B={B:4d} sample, {kind:12s} {ms:8.3f} ms ({ms / one_pass_ms:6.1f} copy passes)", flush=True)
        for name, fn in PIECES.items():
            f = jax.jit(fn)
            ms = 1e3 * timeit(lambda: f(logits), warmup=2, reps=20)
            result["measurements"].append({"batch": B, "what": name, "ms": ms, "passes": ms / one_pass_ms})
            print(f"B={B:4d} {name:20s} {ms:8.3f} ms ({ms / one_pass_ms:6.1f} copy passes)", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
