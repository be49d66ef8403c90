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
  mxfp4  the real thing on the shipped weight encoding (`moe_decode.KernelExperts` words, 8 weights per
         u32 in phase order): one inline-PTX block per word and scale decodes 4 f16x2 pairs (E2M1 * 2^-14
         times the block scale, as f16, with the scales normalised by the row's largest), straight into the
         f16 wgmma A-operand registers (`plgpu.inline_mgpu`); the tokens enter as f16 scaled per token,
         their K order permuted to match the registers (`_mma_perm`).
  mxfp4_ws  the same decode, warp-specialised: a memory warpgroup feeds 128-row tiles to two compute
         warpgroups (`plgpu.emit_pipeline_warp_specialized`).
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
import numpy as np
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.mosaic.gpu import fragmented_array as mfa
from jax.experimental.mosaic.gpu import utils as mu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, memref, vector

from pallas_kernels import moe_decode

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
# MXFP4 on the shipped word encoding

MX_TILE_K = 512  # weights per K step: 64 words and 16 scales (16 bytes, the least a TMA row may be) per row
F16_SCALE_BIAS = 30  # scale byte stored as s - rowmax + 30 (clamped at 0): an f16 exponent field


def _mma_perm(contiguous: bool) -> np.ndarray:
    """Natural weight held by each MMA column of a block: MMA column 32b + 8j + 2c + e is pair j, half e of
    the word that thread c (lane % 4) decodes for 32-column chunk b.  Spread: that word is 4b + c (blocks of
    32, each chunk one E8M0 block); contiguous: it is 16c + b (blocks of 512: each thread's 16 words of a K
    step are adjacent, one 16-byte shared-memory load per 4)."""
    n = MX_TILE_K if contiguous else 32
    m = np.arange(n)
    b, j, c, e = m // 32, (m % 32) // 8, (m % 8) // 2, m % 2
    word = 16 * c + b if contiguous else 4 * b + c
    return 8 * word + j + 4 * e


# One word + its f16x2 scale multiplier -> pair j (f16x2): the decode of `moe_decode._WORD_DOT_PTX`.
_PAIR_PTX = [
    "and.b32 $0, $1, 0x8E008E00; mul.rn.f16x2 $0, $0, $2;",
    "{.reg .b32 t; shl.b32 t, $1, 3; and.b32 t, t, 0x8E008E00; mul.rn.f16x2 $0, t, $2;}",
    "{.reg .b32 t, u; shl.b32 t, $1, 6; shl.b32 u, $1, 1; and.b32 t, t, 0x0E000E00; and.b32 u, u, 0x80008000;"
    " or.b32 t, t, u; mul.rn.f16x2 $0, t, $2;}",
    "{.reg .b32 t, u; shl.b32 t, $1, 9; shl.b32 u, $1, 2; and.b32 t, t, 0x0E000E00; and.b32 u, u, 0x80008000;"
    " or.b32 t, t, u; mul.rn.f16x2 $0, t, $2;}",
]


def _decode_mgpu(ctx, w_ref, s_ref, *, contiguous=False):
    """w_ref u32 [64, 64] words, s_ref u32 [64, 4] scale bytes -> f16 [64, 512] in the wgmma A layout
    (K order: `_mma_perm(contiguous)`)."""
    del ctx
    i32, f16, idx = ir.IntegerType.get_signless(32), ir.F16Type.get(), ir.IndexType.get()
    c = lambda v: mu.c(v, i32)
    tid = mu.thread_idx()
    lane, warp = arith.remui(tid, c(32)), arith.remui(arith.divui(tid, c(32)), c(4))
    # warpgroup w of a warp-specialised CTA decodes rows 64 w .. 64 w + 63 of the tile (w = 0 otherwise)
    row0 = arith.addi(arith.muli(warp, c(16)), arith.divui(lane, c(4)))
    row0 = arith.addi(row0, arith.muli(arith.divui(tid, c(128)), c(TILE_N)))
    col = arith.remui(lane, c(4))
    shape = (64, MX_TILE_K)
    regs = np.empty(mfa.WGMMA_LAYOUT.registers_shape(shape), dtype=object)
    vec_ty = ir.VectorType.get((2,), f16)
    v4 = ir.VectorType.get((4,), i32)
    for h in range(2):
        row = arith.index_cast(idx, arith.addi(row0, c(8 * h)))
        if contiguous:  # words 16c .. 16c + 15 and their 4 scale bytes (u32 c of the row)
            base = arith.muli(col, c(16))
            quads = [vector.load(v4, w_ref, [row, arith.index_cast(idx, arith.addi(base, c(4 * i)))])
                     for i in range(4)]
            words = [vector.extract(quads[b // 4], [], [b % 4]) for b in range(16)]
            sword = memref.load(s_ref, [row, arith.index_cast(idx, col)])
            bytes_ = [arith.andi(arith.shrui(sword, c(8 * (b // 4))), c(0xFF)) for b in range(16)]
        else:  # words 4b + c: one per 32-block
            swords = [memref.load(s_ref, [row, arith.constant(idx, q)]) for q in range(4)]
            words = [memref.load(w_ref, [row, arith.index_cast(idx, arith.addi(col, c(4 * b)))])
                     for b in range(16)]
            bytes_ = [arith.andi(arith.shrui(swords[b // 4], c(8 * (b % 4))), c(0xFF)) for b in range(16)]
        for b in range(MX_TILE_K // 32):
            word, byte = words[b], bytes_[b]
            mult = arith.muli(byte, c(0x04000400))  # (byte << 10) in both f16 halves
            for j in range(4):
                pair = llvm.inline_asm(i32, [word, mult], _PAIR_PTX[j], "=r,r,r")
                ridx = [0] * len(regs.shape)
                ridx[1], ridx[4] = 4 * b + j, h
                regs[tuple(ridx)] = mu.bitcast(pair, vec_ty)
    return mfa.FragmentedArray(_registers=regs, _layout=mfa.WGMMA_LAYOUT, _is_signed=None)


def mxfp4_matmul(words_ENW, sexp_ENQ, x16_ETK, *, stages: int = 3, contiguous: bool = False):
    """acc[e, n, t] = sum_k A[e, n, k] x16[e, t, k] with A the f16 decode (MMA K order); see `mxfp4_inputs`."""
    E, N, W = words_ENW.shape
    T, K = x16_ETK.shape[1:]
    nk = -(-K // MX_TILE_K)
    decode = plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()),
                               return_type=plgpu.ShapeDtypeStruct((TILE_N, MX_TILE_K), jnp.float16,
                                                                  layout=plgpu.Layout.WGMMA))(
        functools.partial(_decode_mgpu, contiguous=contiguous))

    def body(w_gmem, s_gmem, x_gmem, o_gmem, o_smem):
        e, n = jax.lax.axis_index("e"), jax.lax.axis_index("n")

        def acc_scope(acc_ref):
            def step(_, w_smem, s_smem, x_smem):
                plgpu.wgmma(acc_ref, decode(w_smem, s_smem), x_smem.T)
                plgpu.wgmma_wait(0)

            plgpu.emit_pipeline(
                step, grid=(nk,), max_concurrent_steps=stages,
                in_specs=[plgpu.BlockSpec((TILE_N, MX_TILE_K // 8), lambda k: (n, k)),
                          plgpu.BlockSpec((TILE_N, 4), lambda k: (n, k)),
                          plgpu.BlockSpec((T, MX_TILE_K), lambda k: (0, k))],
            )(w_gmem.at[e], s_gmem.at[e], x_gmem.at[e])
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
    return f(words_ENW, sexp_ENQ, x16_ETK)


def mxfp4_matmul_ws(words_ENW, sexp_ENQ, x16_ETK, *, stages: int = 3, contiguous: bool = False):
    """`mxfp4_matmul` warp-specialised: a memory warpgroup runs the TMA pipeline for 128-row tiles and two
    compute warpgroups decode and multiply 64 rows each, sharing the token tile."""
    E, N, W = words_ENW.shape
    T, K = x16_ETK.shape[1:]
    nk = -(-K // MX_TILE_K)
    decode = plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()),
                               return_type=plgpu.ShapeDtypeStruct((TILE_N, MX_TILE_K), jnp.float16,
                                                                  layout=plgpu.Layout.WGMMA))(
        functools.partial(_decode_mgpu, contiguous=contiguous))

    def body(w_gmem, s_gmem, x_gmem, o_gmem, o_smem):
        e, n = jax.lax.axis_index("e"), jax.lax.axis_index("n")
        wg = jax.lax.axis_index("wg")

        def compute_context(eval_pipeline):
            @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((TILE_N, T)))
            def _(acc_ref):
                eval_pipeline(acc_ref)
                o_smem[wg] = acc_ref[...]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[wg], o_gmem.at[e, pl.ds(n * 2 * TILE_N + wg * TILE_N, TILE_N)])
                plgpu.wait_smem_to_gmem(0)

        def step(_, w_smem, s_smem, x_smem, acc_ref):
            plgpu.wgmma(acc_ref, decode(w_smem, s_smem), x_smem.T)
            plgpu.wgmma_wait(0)
            return acc_ref

        plgpu.emit_pipeline_warp_specialized(
            step, grid=(nk,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=stages, compute_context=compute_context,
            in_specs=[plgpu.BlockSpec((2 * TILE_N, MX_TILE_K // 8), lambda k: (n, k)),
                      plgpu.BlockSpec((2 * TILE_N, 4), lambda k: (n, k)),
                      plgpu.BlockSpec((T, MX_TILE_K), lambda k: (0, k))],
        )(w_gmem.at[e], s_gmem.at[e], x_gmem.at[e])

    f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((E, N, T), jnp.float32),
                     scratch_types=[plgpu.SMEM((2, TILE_N, T), jnp.float32)],
                     grid=(E, N // (2 * TILE_N)), grid_names=("e", "n"), num_threads=3, thread_name="wg",
                     compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return f(words_ENW, sexp_ENQ, x16_ETK)


def mxfp4_inputs(words_ENW, scales_ENG, x_ETK, contiguous: bool = False):
    """Kernel inputs from the shipped encoding: scale bytes as normalised f16 exponents padded to 16 per K
    step (u32 view), tokens as f16 scaled per token in MMA K order; and the factors that undo both."""
    E, N, G = scales_ENG.shape
    T, K = x_ETK.shape[1:]
    rowmax = jnp.max(scales_ENG, axis=-1).astype(jnp.int32)  # [E, N]
    sexp = jnp.maximum(scales_ENG.astype(jnp.int32) - rowmax[..., None] + F16_SCALE_BIAS, 0).astype(jnp.uint8)
    Gp = -(-G // 16) * 16
    sexp = jnp.pad(sexp, ((0, 0), (0, 0), (0, Gp - G)))
    sexp = jax.lax.bitcast_convert_type(sexp.reshape(E, N, Gp // 4, 4), jnp.uint32)
    x = x_ETK.astype(jnp.float32)
    _, ex = jnp.frexp(jnp.max(jnp.abs(x), axis=-1))  # [E, T]
    x16 = jnp.ldexp(x, (14 - ex)[..., None]).astype(jnp.float16)
    n = MX_TILE_K if contiguous else 32
    Kp = -(-K // n) * n  # whole permutation blocks; the words past K are TMA zero fill
    x16 = jnp.pad(x16, ((0, 0), (0, 0), (0, Kp - K)))
    x16 = x16.reshape(E, T, Kp // n, n)[..., _mma_perm(contiguous)].reshape(E, T, Kp)
    # A = E2M1 * 2^(s - rowmax + 1), the weight is E2M1 * 2^(s - 127): out = acc * 2^(rowmax - 128) * 2^(ex - 14)
    undo = jnp.ldexp(jnp.ones((E, N, T), jnp.float32), (rowmax - 128)[..., None] + (ex - 14)[:, None, :])
    return sexp, x16, undo


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
                    help="pipeline stages tried for the mxfp4 kernels")
    ap.add_argument("--mx-kernels", default="mxfp4,mxfp4_ws,mxfp4_c,mxfp4_ws_c",
                    help="mxfp4: one warpgroup per CTA; _ws: warp-specialised, two compute warpgroups; _c: each "
                    "thread's words contiguous (16-byte loads)")
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
    kernels = {"mxfp4": mxfp4_matmul, "mxfp4_ws": mxfp4_matmul_ws,
               "mxfp4_c": functools.partial(mxfp4_matmul, contiguous=True),
               "mxfp4_ws_c": functools.partial(mxfp4_matmul_ws, contiguous=True)}
    for T, stages, name in itertools.product([int(t) for t in a.tokens.split(",")], a.mx_stages,
                                             a.mx_kernels.split(",")):
        row = dict(tokens=T, variant=name, K=kd, stages=stages)
        try:
            x = jax.random.normal(kx, (E, T, kd), jnp.bfloat16)
            sexp, x16, undo = jax.jit(mxfp4_inputs, static_argnums=3)(words, scales, x, name.endswith("_c"))
            f = jax.jit(functools.partial(kernels[name], stages=stages))
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
