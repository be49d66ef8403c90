"""Probe: block sizes of jax's Mosaic GPU ragged dot (`ragged_dot_mgpu`) on the 20b prefill MoE's grouped GEMMs.

Sweeps block_n / stages / N-band width for the gate/up (`[P, 2880] x [32, 5760, 2880]^T`) and down
(`[P, 2880] x [32, 2880, 2880]^T`) GEMMs at 16,384 tokens (P = 65,536 routed rows), prints the FLOP rate
against the bf16 matmul ceiling of the same run, checks the best gate/up block against `lax.ragged_dot`, and
times the dequantization of the 32 experts' gate/up weights. `moe_prefill.grouped_matmul` takes the winners.
Run on the GPU: `python3 tools/probe_grouped_gemm.py` (docs/BENCHMARKS.md §4g).
"""
import sys

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as rdm

sys.path.insert(0, "tools")
import bench_kernels as bk  # noqa: E402
import kernel_cases as kc  # noqa: E402
from pallas_kernels import moe_decode, moe_prefill, moe_reference  # noqa: E402


def main(T=16384):
    _, mm = bk.ceilings()
    s = kc.SHAPES["20b"]
    E, D, I, k = s["E"], s["D"], s["I"], s["k"]
    x, rw, rb = kc.router(jax.random.PRNGKey(7), E, D, T)
    idx, _, _ = moe_reference.route(x, rw, rb, k)
    P = T * k
    sizes = jnp.zeros((E,), jnp.int32).at[idx.reshape(-1)].add(1)
    lhs = jax.random.normal(jax.random.PRNGKey(1), (P, D), jnp.float32).astype(jnp.bfloat16)
    wgu = jax.random.normal(jax.random.PRNGKey(2), (E, 2 * I, D), jnp.float32).astype(jnp.bfloat16)
    wdn = jax.random.normal(jax.random.PRNGKey(3), (E, D, I), jnp.float32).astype(jnp.bfloat16)
    for name, rhs, N in (("gate_up", wgu, 2 * I), ("down", wdn, D)):
        flops, best = 2 * P * D * N, None
        for bn in (128, 192, 256):
            for stages in (4, 6):
                for band in (1, 3, 5):
                    if N % (bn * band):
                        continue
                    f = jax.jit(lambda a, b, c, bn=bn, st=stages, band=band: rdm.ragged_dot(
                        a, b, group_sizes=c, block_m=128, block_n=bn, block_k=64, max_concurrent_steps=st,
                        grid_block_n=band, transpose_rhs=True))
                    t = bk.timed(f"{name} bn={bn} stages={stages} band={band}", f, lhs, rhs, sizes, n=5, reps=3)
                    if t is None:
                        continue
                    print(f"  {name} bn={bn} stages={stages} band={band}: {t*1e3:.3f} ms {flops/t/1e12:.0f} TFLOP/s "
                          f"({flops/t/mm*100:.0f}% of matmul)", flush=True)
                    best = min(best or (t, bn, stages, band), (t, bn, stages, band))
        print(f"BEST {name} T={T}: {best}", flush=True)
    small = jnp.zeros((E,), jnp.int32).at[0].set(1000).at[5].set(3000).at[31].set(96)
    got = moe_prefill.grouped_matmul(lhs[:4096], wgu, small).astype(jnp.float32)
    ref = jax.lax.ragged_dot(lhs[:4096], jnp.swapaxes(wgu, 1, 2), small, preferred_element_type=jnp.float32)
    print("grouped_matmul vs lax.ragged_dot: max error / max |ref|",
          float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref))), flush=True)
    kx = jax.jit(moe_decode.prepare_experts)(kc.experts(jax.random.PRNGKey(6), E, D, I))
    dq = jax.jit(lambda a, b: moe_prefill.dequantize(a, b, 0, E * 2 * I, jnp.bfloat16, perm_I=I))
    print(f"dequantize gate/up of {E} experts: "
          f"{bk.timeit(dq, kx.gu_words.reshape(-1, D // 8), kx.gu_scales.reshape(-1, D // 32))*1e3:.3f} ms")


if __name__ == "__main__":
    main()
