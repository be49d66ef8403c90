"""Is the decode MoE GEMV (`moe_gemv`, "gemv16") bound by memory or by its instructions?

Times the kernels for the same number of (token, expert) pairs under three routings: every pair on its own expert
(the bytes of as many experts), all pairs on one expert per layer (its weights stay in the L2, so the time left is the
decode and dot work), and four experts of four pairs each. Separate arrays per layer, as in `bench_kernels`. Run it
under Nsight Compute for the hardware's view of one launch, e.g.

    ncu --clock-control none -k regex:mxfp4_gate_up -c 1 --set full python -m tools.probe_moe_gemv

Launches are BLOCK_N:BLOCK_K:WARPS:STAGES[:p] (p: the register double buffer), as `bench_kernels --moe-launches`.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from gptoss_jax import runtime
from pallas_kernels import expert_format, moe_gemv
from tools import common
from tools import kernel_cases as kc


def routings(E: int, T: int, k: int, L: int) -> dict[str, list]:
    """Per routing name, each layer's `[T, k]` expert ids."""
    rng = np.random.default_rng(0)
    if T * k > E:
        raise ValueError(f"{T} tokens x {k} experts need {T * k} distinct experts; the model has {E}")
    if 4 * L > E:
        raise ValueError(f"{L} layers of four experts each need {4 * L} experts; the model has {E}")
    return {
        "distinct": [jnp.asarray(rng.permutation(E)[: T * k].reshape(T, k), jnp.int32) for _ in range(L)],
        "one": [jnp.full((T, k), i, jnp.int32) for i in range(L)],
        "four": [jnp.asarray(np.tile(np.arange(k) % 4, (T, 1)) + 4 * i, jnp.int32) for i in range(L)],
    }


def main() -> None:
    runtime.prepare()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="20b", choices=sorted(kc.SHAPES))
    ap.add_argument("--tokens", type=int, default=4, help="tokens a layer (a verify step of k = 3 drafts: 4)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--launches", default="16:1024:4:1", help="comma-separated launches (the 2-8 token default)")
    args = ap.parse_args()
    s = kc.SHAPES[args.model]
    E, D, I, k, L, T = s["E"], s["D"], s["I"], s["k"], args.layers, args.tokens
    ex = [jax.jit(expert_format.prepare_experts)(kc.experts(jax.random.PRNGKey(20 + i), E, D, I)) for i in range(L)]
    xs = [jax.random.normal(jax.random.PRNGKey(5 + i), (T, D), jnp.bfloat16) for i in range(L)]
    w = jnp.full((T, k), 1.0 / k, jnp.float32)
    expert_bytes = 3 * I * D // 2 + 3 * I * D // 32  # gate/up and down: 4-bit weights and a byte per 32
    for spec in args.launches.split(","):
        cfg = kc.gemv16_launch(spec)
        cfg.pop("kernel")
        for name, idxs in routings(E, T, k, L).items():

            def run(xs, ex, idxs=idxs):
                return [
                    moe_gemv.experts(xs[i], idxs[i], w, ex[i], swiglu_limit=kc.LIMIT, swiglu_alpha=kc.ALPHA, **cfg)
                    for i in range(L)
                ]

            f = jax.jit(run)
            t = common.timeit(lambda f=f: f(xs, ex), warmup=2, reps=5, calls=10) / L
            distinct = np.mean([len(np.unique(np.asarray(i))) for i in idxs])
            print(
                f"{args.model} T={T} {spec:16s} {name:8s} {t * 1e6:7.1f} us a layer, {distinct:4.1f} distinct experts, "
                f"{distinct * expert_bytes / t / 1e12:5.2f} TB/s of their weights",
                flush=True,
            )


if __name__ == "__main__":
    main()
