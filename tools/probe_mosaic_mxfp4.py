"""Probe: how fast can a Mosaic GPU (plgpu) kernel feed 4-bit expert weights to Hopper wgmma?

The Pallas-Triton MoE kernels decode weight tiles in registers and reach the tensor cores only through
a register -> shared-memory layout conversion (docs/kernels.md); at 8-64 rows per expert they read
weights at ~20% of the copy bandwidth.  Mosaic GPU can TMA the packed tile into shared memory, load it
straight into the wgmma A-operand register layout (`WGMMA_UPCAST_4X`), widen int4 -> bf16 in registers
and issue wgmma with A from registers, B (the expert's tokens) from shared memory.

This probe measures that data path on a batched per-expert matmul `out[e] = W[e] @ x[e]^T` (W int4
[E, N, K], x bf16 [E, T, K]) in three variants that add the work an MXFP4 kernel needs:
  plain  int4 -> bf16 only;
  map    + the E2M1 value map: codes stored as signed int4 v = +-k (k = the 3-bit magnitude code), value
         2 * e2m1 = g(|v|) with g(k) = k + max(k - 4, 0) + 2 max(k - 6, 0), sign from v;
  scale  + one bf16 multiply per weight (a per-row scale per K step, the cost of E8M0 block scales).
  mxfp4  the shipped kernel, `pallas_kernels.moe_mosaic.grouped_matmul` (one slot per expert): the real
         MXFP4 words decoded by inline PTX straight into f16 wgmma A-operand registers (its docstring).
         Two earlier forms were measured with the code of commit 123866a (docs/BENCHMARKS.md §2e): one word
         per 32-block per thread, and a warp-specialised version (a memory warpgroup, two compute warpgroups).
Each is checked against a jnp reference and timed against the copy bandwidth and the Pallas-Triton
"mma" MoE kernels of `pallas_kernels.moe_decode` on the same shapes, same run.

    python3 tools/probe_mosaic_mxfp4.py [--tokens 8,32,64] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import moe_decode, moe_mosaic

TILE_N = 64    # weight rows per CTA: one warpgroup's wgmma M
TILE_K = 256   # int4 elements per K step: 128 bytes, one 128-byte swizzle row


def e2m1_x2(v):
    """Signed int4 code v = +-k as bf16 -> 2 * e2m1 value (exact small integers)."""
    k = jnp.abs(v)
    g = k + jnp.maximum(k - 4, 0) + 2 * jnp.maximum(k - 6, 0)
    return jnp.where(v < 0, -g, g)


def probe_matmul(w_ENK, x_ETK, s_EJN, *, variant: str, stages: int = 3):
    E, N, K = w_ENK.shape
    T = x_ETK.shape[1]

    def body(w_gmem, x_gmem, s_gmem, o_gmem, o_smem):
        e, n = jax.lax.axis_index("e"), jax.lax.axis_index("n")

        def acc_scope(acc_ref):
            def step(_, w_smem, x_smem, s_smem):
                a = w_smem[...].astype(jnp.bfloat16)
                if variant != "plain":
                    a = e2m1_x2(a)
                if variant == "scale":
                    a = a * s_smem[0][:, None]
                plgpu.wgmma(acc_ref, a, x_smem.T)
                plgpu.wgmma_wait(0)

            plgpu.emit_pipeline(
                step, grid=(K // TILE_K,), max_concurrent_steps=stages,
                in_specs=[plgpu.BlockSpec((TILE_N, TILE_K), lambda k: (n, k)),
                          plgpu.BlockSpec((T, TILE_K), lambda k: (0, k)),
                          plgpu.BlockSpec((1, TILE_N), lambda k: (k, n))],
            )(w_gmem.at[e], x_gmem.at[e], s_gmem.at[e])
            return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((TILE_N, T)))
        o_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[e, pl.ds(n * TILE_N, TILE_N)])
        plgpu.wait_smem_to_gmem(0)

    f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((E, N, T), jnp.float32),
                     scratch_types=[plgpu.SMEM((TILE_N, T), jnp.float32)],
                     grid=(E, N // TILE_N), grid_names=("e", "n"),
                     compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return f(w_ENK, x_ETK, s_EJN)


# ----------------------------------------------------------------------------------------------
# MXFP4: the shipped kernel (`moe_mosaic.grouped_matmul`), one slot per expert


def mxfp4_matmul(words_ENW, sexp_ENQ, x16_RK, *, stages: int = 2):
    E = words_ENW.shape[0]
    T = x16_RK.shape[0] // E
    slots = jnp.arange(E, dtype=jnp.int32)
    return moe_mosaic.grouped_matmul(words_ENW, sexp_ENQ, x16_RK, slots, slots, jnp.full((E,), T, jnp.int32),
                                     block_m=T, stages=stages)


def mxfp4_inputs(words_ENW, scales_ENG, x_ETK):
    """The kernel's operands (`moe_mosaic.scale_exponents`, `f16_operand`) and the factor that undoes them."""
    E, T, K = x_ETK.shape
    sexp, row_fac = moe_mosaic.scale_exponents(scales_ENG)
    x16, tok_fac = moe_mosaic.f16_operand(x_ETK.reshape(E * T, K))
    return sexp, x16, row_fac[:, :, None] * tok_fac.reshape(E, 1, T)


def mxfp4_reference(words_ENW, scales_ENG, x_ETK):
    """f32 `W @ x^T` with W the MXFP4 weights the words and scales encode (natural K order)."""
    E, N, W = words_ENW.shape
    vals = jnp.stack(moe_decode._decode_words(words_ENW), axis=-1)  # [E, N, W, 8]: weight 8w + j, * 2^-14
    w = vals.reshape(E, N, W * 8) * 2.0 ** 14
    w = w * jnp.repeat(jnp.exp2(scales_ENG.astype(jnp.float32) - 127), 32, axis=-1)
    return jnp.einsum("enk,etk->ent", w, x_ETK.astype(jnp.float32), precision="highest")


def reference(w_ENK, x_ETK, s_EJN, variant):
    a = w_ENK.astype(jnp.float32)
    if variant != "plain":
        a = e2m1_x2(a)
    if variant == "scale":
        E, N, K = w_ENK.shape
        a = a * jnp.repeat(jnp.swapaxes(s_EJN, 1, 2).astype(jnp.float32), TILE_K, axis=2)
    return jnp.einsum("enk,etk->ent", a, x_ETK.astype(jnp.float32), precision="highest")


def timeit(f, *args, reps=20):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def copy_bandwidth():
    x = jnp.zeros((1 << 28,), jnp.float32)
    f = jax.jit(lambda a: a + 1)
    return 2 * x.nbytes / timeit(f, x) / 1e12


def triton_moe(T_tokens, E, D, I, key):
    """The shipped Pallas-Triton MoE (`moe_decode.experts_forward`, its decode_config) at T tokens, top-4."""
    from pallas_kernels import moe_decode
    k1, k2, k3 = jax.random.split(key, 3)
    kexp = moe_decode.KernelExperts(
        gu_words=jax.random.bits(k1, (E, 2, I, D // 8), jnp.uint32),
        gu_scales=jnp.full((E, 2, I, D // 32), 120, jnp.uint8), gu_bias=jnp.zeros((E, 2, I), jnp.bfloat16),
        dn_words=jax.random.bits(k2, (E, D, I // 8), jnp.uint32),
        dn_scales=jnp.full((E, D, I // 32), 120, jnp.uint8), dn_bias=jnp.zeros((E, D), jnp.bfloat16))
    idx = jnp.argsort(jax.random.uniform(k3, (T_tokens, E)), axis=1)[:, :4].astype(jnp.int32)
    w = jnp.full((T_tokens, 4), 0.25, jnp.float32)
    x = jax.random.normal(k3, (T_tokens, D), jnp.bfloat16)
    cfg = moe_decode.decode_config(T_tokens, 4, E, half=True)
    f = jax.jit(lambda x, idx, w, kexp: moe_decode.experts_forward(x, idx, w, kexp, swiglu_limit=7.0,
                                                                  swiglu_alpha=1.702, **cfg))
    t = timeit(f, x, idx, w, kexp)
    distinct = int(jnp.unique(idx).size)
    return t, distinct * (2 * I * D + D * I), cfg


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--n", type=int, default=5760, help="weight rows per expert (20b gate_up: 5,760)")
    ap.add_argument("--k", type=int, default=2816, help="K (multiple of 256; 20b has 2,880)")
    ap.add_argument("--tokens", default="8,32,64", help="tokens per expert")
    ap.add_argument("--variants", default="plain,map,scale", help="int4 variants ('' for none)")
    ap.add_argument("--stages", type=int, default=3, help="pipeline stages of the int4 variants")
    ap.add_argument("--mx-stages", type=lambda v: [int(x) for x in v.split(",")], default=[2, 3],
                    help="pipeline stages tried for the mxfp4 kernel")
    ap.add_argument("--skip-triton", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    E, N, K = a.experts, a.n, a.k
    key = jax.random.key(0)
    kw, kx, ks = jax.random.split(key, 3)
    w = jax.random.randint(kw, (E, N, K), -7, 8, jnp.int32).astype(jnp.int4)
    s = jnp.exp2(jax.random.randint(ks, (E, K // TILE_K, N), -3, 3).astype(jnp.float32)).astype(jnp.bfloat16)
    copy = copy_bandwidth()
    print(f"device {jax.devices()[0].device_kind}; copy bandwidth {copy:.2f} TB/s; E={E} N={N} K={K}")
    rows = []
    for T in [int(t) for t in a.tokens.split(",")]:
        x = jax.random.normal(kx, (E, T, K), jnp.bfloat16)
        for v in filter(None, a.variants.split(",")):
            row = dict(tokens=T, variant=v)
            try:
                f = jax.jit(functools.partial(probe_matmul, variant=v, stages=a.stages))
                out = f(w, x, s)
                ref = reference(w, x, s, v)
                row["max_rel_err"] = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
                t = timeit(f, w, x, s)
                row["us"] = t * 1e6
                row["weights_per_s"] = E * N * K / t
                row["frac_copy"] = E * N * K / 2 / t / (copy * 1e12)
                row["tflops"] = 2 * E * N * K * T / t / 1e12
            except Exception as err:  # a probe: report and go on
                row["error"] = f"{type(err).__name__}: {str(err)[:2000]}"
            print(row, flush=True)
            rows.append(row)
    kd = 2880
    words = jax.random.bits(kw, (E, N, kd // 8), jnp.uint32)
    scales = jax.random.randint(ks, (E, N, kd // 32), 112, 124).astype(jnp.uint8)
    for T, stages in itertools.product([int(t) for t in a.tokens.split(",")], a.mx_stages):
        row = dict(tokens=T, variant="mxfp4", K=kd, stages=stages)
        try:
            x = jax.random.normal(kx, (E, T, kd), jnp.bfloat16)
            sexp, x16, undo = jax.jit(mxfp4_inputs)(words, scales, x)
            f = jax.jit(functools.partial(mxfp4_matmul, stages=stages))
            out = f(words, sexp, x16) * undo
            ref = mxfp4_reference(words, scales, x)
            row["max_rel_err"] = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
            t = timeit(f, words, sexp, x16)
            row["us"] = t * 1e6
            row["weights_per_s"] = E * N * kd / t
            row["frac_copy"] = E * N * kd * 4.25 / 8 / t / (copy * 1e12)
            row["tflops"] = 2 * E * N * kd * T / t / 1e12
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {str(err)[:3000]}"
        print(row, flush=True)
        rows.append(row)
    for T in [] if a.skip_triton else [int(t) for t in a.tokens.split(",")]:
        try:
            t, weights, cfg = triton_moe(T * E // 4, E, 2880, 2880, key)
            row = dict(variant="triton_moe_gate_up+down", tokens_per_expert=T, us=t * 1e6, weights_per_s=weights / t,
                       frac_copy=weights * 4.25 / 8 / t / (copy * 1e12), kernel=cfg["kernel"], block_m=cfg["block_m"])
        except Exception as err:
            row = dict(variant="triton_moe", tokens_per_expert=T, error=f"{type(err).__name__}: {str(err)[:1000]}")
        print(row, flush=True)
        rows.append(row)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(device=jax.devices()[0].device_kind, copy_bandwidth_TBps=copy, E=E, N=N, K=K,
                           probes=rows), fh, indent=1)


if __name__ == "__main__":
    main()
