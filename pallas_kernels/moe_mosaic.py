"""Mid-batch MXFP4 mixture-of-experts on Hopper: a Mosaic GPU grouped matmul that decodes the packed experts
straight into the wgmma A-operand registers.

Backend: **Mosaic GPU** (`plgpu`), because the Pallas-Triton kernels of `moe_mma` reach the tensor cores
only through a register -> shared-memory layout conversion per K step and stall at ~1.1-1.7e12 weights/s
at 8-64 rows per expert.  Here TMA streams the words, each thread decodes the words of its own A fragment
with one inline-PTX block per f16x2 pair (E2M1 bits placed as an f16 * 2^-14, times the block scale) and
wgmma takes A from registers, B (the slot's tokens) from shared memory: 3.2e12 weights/s at 8 rows per
expert on an H200 (tools/probe_mosaic_mxfp4.py, docs/BENCHMARKS.md §2e).  Mosaic's CPU interpreter does
not run register-operand wgmma, so off-GPU each kernel's jnp reference (`*_reference`, the same function)
stands in and CI tests the glue; on the GPU the same tests and tools/check_kernels.py run the kernels.

The matmul reads the same re-encoded words as the other kernels (`KernelExperts`: 8 weights of a row per
u32, in phase order).  Thread `c` (lane % 4) of a K step of 512 weights decodes 16-byte chunks `c, c + 4, c + 8,
c + 12` of its rows; pair `j`, half `e` of its b-th word (`_thread_word`) lands in MMA column `32b + 8j + 2c + e`.
So the tokens enter in that K order (`mma_perm`), as f16 scaled per token to |x| < 2^14.  Scales enter as f16
exponent fields relative to their row's largest scale (`scale_exponents`, stored at load by
`pallas_kernels.prepare_params`: a block 2^30 or more below its row's largest reads as 0); the row factor
returns in the epilogue.

Two kernels, their epilogues in registers (`plgpu.inline_mgpu`):
- `gate_up_act`: one 64-row MMA tile is 32 features' gate rows and their up rows, read so that each thread
  holds a feature's gate and up values; factors, biases and the clamped SwiGLU run in registers and the f16
  activation (times a fixed power of two, `act_exponent`) lands straight in the down's operand, in its MMA K
  order. A CTA makes whole 16-byte runs of that operand (four tiles in one TMA pipeline), so it is staged in
  shared memory and written by one TMA store; the K padding comes out 0.
- `down_out`: row factor, bias and routing weight in registers; f32 token rows stored for `combine`.
XLA is left with the dispatch (`moe_slots.slots`), each token's operand row (once per token, then copied to
its slots) and the final sum over each token's experts.

Layout: (token, expert) pairs sorted by expert and cut into slots of `block_m` rows (`moe_slots.slots`);
every slot owns rows `s * block_m ...` of the operand buffers, so outputs never overlap; an empty slot's CTAs
exit at once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mfa
from jax.experimental.mosaic.gpu import utils as mu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, memref, vector

from pallas_kernels import moe_slots
from pallas_kernels.expert_format import KernelExperts, clamped_swiglu, decode_words, phase_order

TILE_N = 64  # weight rows per CTA: one warpgroup's wgmma M
TILE_K = 512  # weights per K step: 64 words and 16 scale bytes (the least TMA moves per row) per row
SCALE_BIAS = 30  # scale byte stored as s - rowmax + 30: an f16 exponent field (2^(s - rowmax + 15))


def fits(D: int, I: int) -> bool:
    """Whether the expert shapes tile: D in 64-row down tiles, I a multiple of 64 (the gate/up kernel's
    `[2, 8, I/8, W]` view takes 32-word boxes with 16-byte strides), and K (D or I) at least one K step (TMA fills
    the last step's words past K with zeros, but no box may exceed a dimension). Mosaic GPU runs on Hopper only
    (wgmma exists on sm_90: not on Ampere, and Blackwell has tcgen05 instead): `pallas_kernels.choice` decides."""
    return D % TILE_N == 0 and I % TILE_N == 0 and min(D, I) >= TILE_K


def mma_perm() -> np.ndarray:
    """The natural K index (within a K step) that each MMA column of the step holds."""
    m = np.arange(TILE_K)
    b, j, c, e = m // 32, (m % 32) // 8, (m % 8) // 2, m % 2
    return 8 * _thread_word(c, b) + j + 4 * e


def _thread_word(c, b):
    """The word (of a K step's 64) that thread c decodes b-th (b < 16): word b % 4 of the 16-byte chunk
    4 (b // 4) + c. A quarter warp (2 rows 256 bytes apart, threads c < 4) so reads 4 bank groups a load, and 8 with
    `_decode_fragment`'s swap of odd rows: no conflict. Adjacent words `16c + b` a thread put 16 lanes on one group
    (Nsight Compute's 12.8-way conflicts, docs/BENCHMARKS.md §30.5)."""
    return 16 * (b // 4) + 4 * c + b % 4


def scale_exponents(scales_ENG: jax.Array) -> tuple[jax.Array, jax.Array]:
    """E8M0 scales `[E, N, G]` -> (u32 `[E, N, Gp / 4]`: bytes s - rowmax + SCALE_BIAS clamped at 0, padded to
    whole K steps, each step's 16 transposed 4 x 4 so that u32 c holds the scales of thread c's chunks; f32
    `[E, N]`: 2^(rowmax - 128), the factor that restores each row's scale)."""
    E, N, G = scales_ENG.shape
    rowmax = jnp.max(scales_ENG, axis=-1).astype(jnp.int32)
    sexp = jnp.maximum(scales_ENG.astype(jnp.int32) - rowmax[..., None] + SCALE_BIAS, 0).astype(jnp.uint8)
    Gp = -(-G // (TILE_K // 32)) * (TILE_K // 32)
    sexp = jnp.pad(sexp, ((0, 0), (0, 0), (0, Gp - G)))
    sexp = jnp.swapaxes(sexp.reshape(E, N, Gp // 16, 4, 4), -1, -2).reshape(E, N, Gp)  # u32 c: blocks 4i + c
    return (
        jax.lax.bitcast_convert_type(sexp.reshape(E, N, Gp // 4, 4), jnp.uint32),
        jnp.ldexp(jnp.ones((E, N), jnp.float32), rowmax - 128),
    )


def scale_operands(gu_scales: jax.Array, dn_scales: jax.Array) -> tuple[jax.Array, ...]:
    """One layer's `scale_exponents` for both matmuls, `(gu_sexp, gu_rowfac, dn_sexp, dn_rowfac)` as
    `KernelExperts` stores them: `gu_scales` `[E, 2, I, D/32]`, `dn_scales` `[E, D, I/32]`."""
    E, _, I, G = gu_scales.shape
    return (*scale_exponents(gu_scales.reshape(E, 2 * I, G)), *scale_exponents(dn_scales))


def f16_operand(x_RK: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rows -> (f16 `[R, Kp]` scaled per row to |x| < 2^14 and in MMA K order, zero-padded to whole K steps;
    f32 `[R]`: the factor that undoes the scaling)."""
    R, K = x_RK.shape
    x = x_RK.astype(jnp.float32)
    _, ex = jnp.frexp(jnp.max(jnp.abs(x), axis=-1))
    x16 = jnp.ldexp(x, (14 - ex)[:, None]).astype(jnp.float16)
    Kp = -(-K // TILE_K) * TILE_K
    x16 = jnp.pad(x16, ((0, 0), (0, Kp - K))).reshape(R, Kp // TILE_K, TILE_K)[..., mma_perm()]
    return x16.reshape(R, Kp), jnp.ldexp(jnp.ones((R,), jnp.float32), ex - 14)


def _padded(K: int) -> int:
    return -(-K // TILE_K) * TILE_K


def act_positions(I: int) -> np.ndarray:
    """The down's operand column (MMA K order) of each stored gate/up row q, which holds feature
    `phase_order(I)[q]`."""
    f = phase_order(I)
    return f // TILE_K * TILE_K + np.argsort(mma_perm())[f % TILE_K]


def act_exponent(swiglu_limit: float) -> int:
    """The power of two the activation is stored times: |SwiGLU| <= limit * (limit + 1) (the gate clamped at
    `limit`, the up at +-`limit`), so the scaled f16 stays within 2^14 like the token operand."""
    return 14 - int(np.ceil(np.log2(swiglu_limit * (swiglu_limit + 1))))


# ----------------------------------------------------------------------------------------------
# The kernel

# One word + its f16x2 scale multiplier -> decoded pair j as f16x2 (low half weight j, high half j + 4):
# the bit placement of `moe_gemv._WORD_DOT_PTX`, then one multiply.
_PAIR_PTX = [
    "and.b32 $0, $1, 0x8E008E00; mul.rn.f16x2 $0, $0, $2;",
    "{.reg .b32 t; shl.b32 t, $1, 3; and.b32 t, t, 0x8E008E00; mul.rn.f16x2 $0, t, $2;}",
    "{.reg .b32 t, u; shl.b32 t, $1, 6; shl.b32 u, $1, 1; and.b32 t, t, 0x0E000E00; and.b32 u, u, 0x80008000;"
    " or.b32 t, t, u; mul.rn.f16x2 $0, t, $2;}",
    "{.reg .b32 t, u; shl.b32 t, $1, 9; shl.b32 u, $1, 2; and.b32 t, t, 0x0E000E00; and.b32 u, u, 0x80008000;"
    " or.b32 t, t, u; mul.rn.f16x2 $0, t, $2;}",
]


def _decode_fragment(ctx, w_ref, s_ref):
    """Words u32 `[64, 64]` and scale bytes u32 `[64, 4]` of one K step -> f16 `[64, 512]` in the wgmma A
    layout (thread (warp w, lane l) holds rows 16w + l/4 (+8) and the columns of `mma_perm`). A tile of two
    32-row halves (`[2, 32, 64]`, `[2, 32, 4]`: gate and up rows) is read so that MMA row 16w + 8h + l/4 holds
    half h's row 8w + l/4: each thread holds a feature's gate and up rows. Odd rows load their chunks in the order
    4 + c, c, 12 + c, 8 + c (then swap them back): a quarter warp's two rows read opposite halves of 128 bytes."""
    del ctx
    i32, f16, idx = ir.IntegerType.get_signless(32), ir.F16Type.get(), ir.IndexType.get()
    c = lambda v: mu.c(v, i32)
    tid = mu.thread_idx()
    lane, warp = arith.remui(tid, c(32)), arith.remui(arith.divui(tid, c(32)), c(4))
    row0 = arith.addi(arith.muli(warp, c(16)), arith.divui(lane, c(4)))
    col = arith.remui(lane, c(4))
    odd = arith.andi(arith.divui(lane, c(4)), c(1))
    swap = arith.cmpi(arith.CmpIPredicate.ne, odd, c(0))
    regs = np.empty(mfa.WGMMA_LAYOUT.registers_shape((TILE_N, TILE_K)), dtype=object)
    v4, pair_ty = ir.VectorType.get((4,), i32), ir.VectorType.get((2,), f16)
    for h in range(2):
        row = arith.addi(row0, c(8 * h))
        if ir.MemRefType(w_ref.type).rank == 2:
            lead = [row]
        else:
            lead = [c(h), arith.addi(arith.muli(warp, c(8)), arith.divui(lane, c(4)))]
        at = lambda i, lead=lead: [arith.index_cast(idx, v) for v in lead] + [i]  # noqa: E731
        base = arith.muli(col, c(4))
        # load i reads chunk 4 (i ^ odd) + c
        got = [
            vector.load(
                v4, w_ref, at(arith.index_cast(idx, arith.addi(base, arith.muli(arith.xori(odd, c(i)), c(16)))))
            )
            for i in range(4)
        ]
        quads = [arith.select(swap, got[i ^ 1], got[i]) for i in range(4)]  # quads[i]: chunk 4i + c
        sword = memref.load(s_ref, at(arith.index_cast(idx, col)))  # byte i: the scale of chunk 4i + c
        for b in range(TILE_K // 32):
            word = vector.extract(quads[b // 4], [], [b % 4])
            byte = arith.andi(arith.shrui(sword, c(8 * (b // 4))), c(0xFF))
            mult = arith.muli(byte, c(0x04000400))  # the byte as the exponent field of both f16 halves
            for j in range(4):
                pair = llvm.inline_asm(i32, [word, mult], _PAIR_PTX[j], "=r,r,r")
                ridx = [0] * regs.ndim
                ridx[1], ridx[4] = 4 * b + j, h  # 8-column group, row half
                regs[tuple(ridx)] = mu.bitcast(pair, pair_ty)
    return mfa.FragmentedArray(_registers=regs, _layout=mfa.WGMMA_LAYOUT, _is_signed=None)


def _elements(acc):
    """(row, column, value) of every element this thread holds of a `[64, bm]` accumulator."""
    index = ir.IndexType.get()
    for idx, reg in zip(acc.layout.thread_idxs(acc.shape), acc.registers.flat, strict=True):
        for i in range(ir.VectorType(reg.type).shape[0]):
            yield (
                idx[0],
                arith.addi(idx[1], mu.c(i, index)),
                vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i])),
            )


def _gate_up_epilogue(limit: float, alpha: float, scale: float):
    """In-register epilogue of gate/up tile (e, h) = divmod(`tile`, 2) (`_decode_fragment`'s two-half reading:
    each thread holds a feature's gate and up values for its columns): row and token factors (`rowfac`, `bias`
    `[gate/up, e, 64]`, `tok_fac` `[bm]`), biases, the clamped SwiGLU, times `scale`, f16 into
    `stage[token, b, 2c + e]` for the tile's feature f < 32, its word 32h + f = `_thread_word(c, b)`. Smem refs go
    whole (a strided view would stop Mosaic's layout inference); the tile index comes as a scalar."""
    ref = plgpu.RefType()

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA, ref, ref, ref, ref))
    def epilogue(ctx, acc, tile, rowfac, bias, tok_fac, stage):
        del ctx
        f32, f16, idx = ir.F32Type.get(), ir.F16Type.get(), ir.IndexType.get()
        c = lambda v: arith.constant(f32, v)  # noqa: E731
        ci = lambda v: mu.c(v, idx)  # noqa: E731
        tile = arith.index_cast(idx, tile.registers.flat[0])  # a scalar arrives as a splat array
        e, hw = arith.divui(tile, ci(2)), arith.remui(tile, ci(2))
        where = dict(zip(np.ndindex(acc.registers.shape), acc.layout.thread_idxs(acc.shape), strict=True))
        for gi in (r for r in np.ndindex(acc.registers.shape) if r[4] == 0):  # dim 4: the row half (gate, up)
            ui = gi[:4] + (1,) + gi[5:]
            row, col0 = where[gi]
            f = arith.addi(arith.muli(arith.divui(row, ci(16)), ci(8)), arith.remui(row, ci(8)))  # 8w + l/4
            fw = arith.addi(arith.muli(hw, ci(32)), f)  # its word within the CTA's 64: _thread_word(c, b)
            b = arith.addi(arith.muli(arith.divui(fw, ci(16)), ci(4)), arith.remui(fw, ci(4)))
            pos = arith.muli(arith.divui(arith.remui(fw, ci(16)), ci(4)), ci(2))  # 2c
            for i in range(2):
                col = arith.addi(col0, ci(i))
                at = ir.DenseI64ArrayAttr.get([i])
                vg, vu = (vector.extract(acc.registers[r], dynamic_position=[], static_position=at) for r in (gi, ui))
                tf = memref.load(tok_fac, [col])
                g = arith.addf(
                    arith.mulf(arith.mulf(vg, memref.load(rowfac, [ci(0), e, fw])), tf),
                    memref.load(bias, [ci(0), e, fw]),
                )
                u = arith.addf(
                    arith.mulf(arith.mulf(vu, memref.load(rowfac, [ci(1), e, fw])), tf),
                    memref.load(bias, [ci(1), e, fw]),
                )
                g = arith.minimumf(g, c(limit))
                u = arith.maximumf(arith.minimumf(u, c(limit)), c(-limit))
                ex = llvm.inline_asm(
                    f32, [arith.mulf(g, c(-alpha * float(np.log2(np.e))))], "ex2.approx.ftz.f32 $0, $1;", "=f,f"
                )
                act = arith.mulf(arith.divf(g, arith.addf(ex, c(1.0))), arith.addf(u, c(1.0)))
                memref.store(
                    arith.truncf(f16, arith.mulf(act, c(scale))),
                    stage,
                    [col, b, arith.addi(pos, e)],
                )

    return epilogue


def _down_epilogue(act_fac: float):
    """In-register epilogue of a down tile: (acc * row factor * `act_fac` + bias) * routing weight, f32, stored
    transposed (`out` `[bm, 64]`: token rows). Every load comes before the first store."""
    ref = plgpu.RefType()

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, ref, ref, ref, ref))
    def epilogue(ctx, acc, rowfac, bias, w, out):
        del ctx
        cf = arith.constant(ir.F32Type.get(), act_fac)
        ys = [
            (
                r,
                col,
                arith.mulf(
                    arith.addf(arith.mulf(arith.mulf(v, memref.load(rowfac, [r])), cf), memref.load(bias, [r])),
                    memref.load(w, [col]),
                ),
            )
            for r, col, v in _elements(acc)
        ]
        for r, col, y in ys:
            memref.store(y, out, [col, r])

    return epilogue


def _tiles_loop(
    tile_epilogue, w_ref, s_ref, x_ref, w_block, s_block, index, *, tiles: int, Kp: int, block_m: int, stages: int
):
    """A CTA's `tiles` weight tiles in one TMA pipeline over (tile, K step), so the next tile's first loads are
    in flight during a tile's epilogue: `tile_epilogue(tile, acc)` after each tile's last step."""
    decode = plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(), plgpu.RefType()),
        return_type=plgpu.ShapeDtypeStruct((TILE_N, TILE_K), jnp.float16, layout=plgpu.Layout.WGMMA),
    )(_decode_fragment)
    nk = Kp // TILE_K

    def scope(acc_ref):
        def step(ix, w_smem, s_smem, x_smem):
            tile, k = ix
            plgpu.wgmma(acc_ref, decode(w_smem, s_smem), x_smem.T)
            plgpu.wgmma_wait(0)

            @pl.when(k == nk - 1)
            def _():
                tile_epilogue(tile, acc_ref[...])
                acc_ref[...] = jnp.zeros((TILE_N, block_m), jnp.float32)

        plgpu.emit_pipeline(
            step,
            grid=(tiles, nk),
            max_concurrent_steps=stages,
            in_specs=[
                plgpu.BlockSpec(w_block, index),
                plgpu.BlockSpec(s_block, index),
                plgpu.BlockSpec((block_m, TILE_K), lambda t, k: (0, k)),
            ],
        )(w_ref, s_ref, x_ref)

    pl.run_scoped(scope, plgpu.ACC((TILE_N, block_m)))


def _prefetch(pairs, bars):
    """Starts TMA copies gmem -> smem (one barrier each); returns the wait for all of them (call it once)."""
    for i, (src, dst) in enumerate(pairs):
        plgpu.copy_gmem_to_smem(src, dst, bars.at[i])

    def wait():
        for i in range(len(pairs)):
            plgpu.barrier_wait(bars.at[i])

    return wait


def gate_up_act(
    words_ENW,
    sexp_ENQ,
    rowfac_EN,
    bias_EN,
    x16_RK,
    tok_fac_R,
    slot_ew_S,
    slot_es_S,
    slot_rows_S,
    *,
    block_m: int,
    stages: int,
    swiglu_limit: float,
    swiglu_alpha: float,
    act_scale: float,
):
    """The down's f16 operand `[S * block_m, Kp(I)]` in its MMA K order: slot s's rows `x16[s * block_m ...]`
    through expert `slot_ew[s]`'s gate and up rows (`words` rows `[0, I)` and `[I, 2I)` in phase order, scales
    of expert `slot_es[s]`), the row and token factors, biases (`bias` `[E, 2I]` f32, by `slot_ew[s] % E`) and
    the clamped SwiGLU, times `act_scale`; the K padding holds zeros. Rows of empty slots are left unwritten.

    CTA (s, j, t) makes the operand's columns `512t + 32b + 8j + [0, 8)` for b < 16: features 512t + 8u + 4e + j
    (c < 4, e < 2, u = `_thread_word(c, b)`), i.e. stored rows (p = 4e + j, word 64t + u): four tiles (e, 32-word
    half) of a feature's gate and up rows, one TMA box each of the `[2, 8, I/8, W]` view (words past I/8 read as 0,
    so the padding comes out 0). Each 16-byte run of the output is whole within one CTA: staged in shared memory,
    one TMA store."""
    I = words_ENW.shape[1] // 2
    E = bias_EN.shape[0]
    S, Kp, Kp_out = slot_rows_S.shape[0], x16_RK.shape[1], _padded(I)
    view = lambda a: a.reshape(a.shape[0], 2, 8, I // 8, *a.shape[2:])  # noqa: E731  [.., gate/up, p, word, ..]
    vec = lambda a: a.reshape(a.shape[0], 2, 2, 4, I // 8)  # noqa: E731  [.., gate/up, e, j, word]
    epilogue = _gate_up_epilogue(swiglu_limit, swiglu_alpha, act_scale)

    def gate_up_body(
        ew_gmem,
        es_gmem,
        rows_gmem,
        w_gmem,
        s_gmem,
        rf_gmem,
        b_gmem,
        x_gmem,
        tf_gmem,
        o_gmem,
        rf_smem,
        b_smem,
        tf_smem,
        stage,
        bars,
    ):
        s, j, t = jax.lax.axis_index("s"), jax.lax.axis_index("j"), jax.lax.axis_index("t")

        @pl.when(rows_gmem[s] > 0)
        def _():
            ew, es = ew_gmem[s], es_gmem[s]
            toks, words = pl.ds(s * block_m, block_m), pl.ds(t * 64, 64)
            wait = _prefetch(
                (
                    (rf_gmem.at[es, :, :, j, words], rf_smem),
                    (b_gmem.at[ew % E, :, :, j, words], b_smem),
                    (tf_gmem.at[toks], tf_smem),
                ),
                bars,
            )

            def tile_epilogue(tile, acc):  # tile = (e, half): words 64t + 32 half + [0, 32) of phase 4e + j
                pl.when(tile == 0)(wait)
                epilogue(acc, tile, rf_smem, b_smem, tf_smem, stage)

            _tiles_loop(
                tile_epilogue,
                w_gmem.at[ew],
                s_gmem.at[es],
                x_gmem.at[toks],
                (2, None, 32, TILE_K // 8),
                (2, None, 32, TILE_K // 128),
                lambda tile, k: (0, j + 4 * (tile // 2), 2 * t + tile % 2, k),
                tiles=4,
                Kp=Kp,
                block_m=block_m,
                stages=stages,
            )
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(stage, o_gmem.at[toks, t, :, j, :])
            plgpu.wait_smem_to_gmem(0)

    # output [R, t, b, j, 2c + e] = column 512t + 32b + 8j + 2c + e
    f = plgpu.kernel(
        gate_up_body,
        out_type=jax.ShapeDtypeStruct((S * block_m, Kp_out // TILE_K, 16, 4, 8), jnp.float16),
        scratch_types=[
            plgpu.SMEM((2, 2, 64), jnp.float32),
            plgpu.SMEM((2, 2, 64), jnp.float32),
            plgpu.SMEM((block_m,), jnp.float32),
            plgpu.SMEM((block_m, 16, 8), jnp.float16),
            plgpu.Barrier(num_barriers=3),
        ],
        grid=(S, 4, Kp_out // TILE_K),
        grid_names=("s", "j", "t"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    out = f(
        slot_ew_S,
        slot_es_S,
        slot_rows_S,
        view(words_ENW),
        view(sexp_ENQ),
        vec(rowfac_EN),
        vec(bias_EN),
        x16_RK,
        tok_fac_R,
    )
    return out.reshape(S * block_m, Kp_out)


def down_out(
    words_ENW,
    sexp_ENQ,
    rowfac_EN,
    bias_EN,
    a16_RK,
    w_R,
    slot_ew_S,
    slot_es_S,
    slot_rows_S,
    *,
    act_fac: float,
    block_m: int,
    stages: int,
):
    """f32 `[S * block_m, N]`: slot s's operand rows through expert `slot_ew[s]`'s rows, times the row factor
    and `act_fac`, plus the bias (`[E, N]` f32, by `slot_ew[s] % E`), times each row's routing weight `w_R`.
    Rows of empty slots are left unwritten. (Three tiles per CTA measured the same as one.)"""
    N = words_ENW.shape[1]
    E = bias_EN.shape[0]
    S, Kp = slot_rows_S.shape[0], a16_RK.shape[1]
    epilogue = _down_epilogue(act_fac)

    def down_body(
        ew_gmem,
        es_gmem,
        rows_gmem,
        w_gmem,
        s_gmem,
        rf_gmem,
        b_gmem,
        x_gmem,
        wr_gmem,
        o_gmem,
        rf_smem,
        b_smem,
        wr_smem,
        bars,
    ):
        s, n = jax.lax.axis_index("s"), jax.lax.axis_index("n")

        @pl.when(rows_gmem[s] > 0)
        def _():
            ew, es = ew_gmem[s], es_gmem[s]
            rows, toks = pl.ds(n * TILE_N, TILE_N), pl.ds(s * block_m, block_m)
            wait = _prefetch(
                ((rf_gmem.at[es, rows], rf_smem), (b_gmem.at[ew % E, rows], b_smem), (wr_gmem.at[toks], wr_smem)), bars
            )

            def tile_epilogue(tile, acc):
                wait()
                epilogue(acc, rf_smem, b_smem, wr_smem, o_gmem.at[toks, rows])

            _tiles_loop(
                tile_epilogue,
                w_gmem.at[ew],
                s_gmem.at[es],
                x_gmem.at[toks],
                (TILE_N, TILE_K // 8),
                (TILE_N, TILE_K // 128),
                lambda tile, k: (n, k),
                tiles=1,
                Kp=Kp,
                block_m=block_m,
                stages=stages,
            )

    f = plgpu.kernel(
        down_body,
        out_type=jax.ShapeDtypeStruct((S * block_m, N), jnp.float32),
        scratch_types=[
            plgpu.SMEM((TILE_N,), jnp.float32),
            plgpu.SMEM((TILE_N,), jnp.float32),
            plgpu.SMEM((block_m,), jnp.float32),
            plgpu.Barrier(num_barriers=3),
        ],
        grid=(S, N // TILE_N),
        grid_names=("s", "n"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return f(slot_ew_S, slot_es_S, slot_rows_S, words_ENW, sexp_ENQ, rowfac_EN, bias_EN, a16_RK, w_R)


def grouped_matmul(words_ENW, sexp_ENQ, x16_RK, slot_ew_S, slot_es_S, slot_rows_S, *, block_m: int, stages: int = 2):
    """acc `[S, N, block_m]` f32: slot s's rows `x16[s * block_m ...]` times expert `slot_ew[s]`'s decoded
    words (`sexp` of expert `slot_es[s]`), in MMA K order, before the row and token factors: the bare matmul
    that tools/probe_mosaic_mxfp4.py times. Rows of empty slots are left unwritten."""
    N = words_ENW.shape[1]
    S, Kp = slot_rows_S.shape[0], x16_RK.shape[1]

    def matmul_body(ew_gmem, es_gmem, rows_gmem, w_gmem, s_gmem, x_gmem, o_gmem, o_smem):
        s, n = jax.lax.axis_index("s"), jax.lax.axis_index("n")

        @pl.when(rows_gmem[s] > 0)
        def _():
            def store(tile, acc):
                del tile
                o_smem[...] = acc
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[s, pl.ds(n * TILE_N, TILE_N)])
                plgpu.wait_smem_to_gmem(0)

            _tiles_loop(
                store,
                w_gmem.at[ew_gmem[s]],
                s_gmem.at[es_gmem[s]],
                x_gmem.at[pl.ds(s * block_m, block_m)],
                (TILE_N, TILE_K // 8),
                (TILE_N, TILE_K // 128),
                lambda tile, k: (n, k),
                tiles=1,
                Kp=Kp,
                block_m=block_m,
                stages=stages,
            )

    f = plgpu.kernel(
        matmul_body,
        out_type=jax.ShapeDtypeStruct((S, N, block_m), jnp.float32),
        scratch_types=[plgpu.SMEM((TILE_N, block_m), jnp.float32)],
        grid=(S, N // TILE_N),
        grid_names=("s", "n"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return f(slot_ew_S, slot_es_S, slot_rows_S, words_ENW, sexp_ENQ, x16_RK)


def grouped_matmul_reference(
    words_ENW, sexp_ENQ, x16_RK, slot_ew_S, slot_es_S, slot_rows_S, *, block_m: int, stages: int = 2
):
    """`grouped_matmul` in jnp, the same arithmetic (f16 decoded weights times their f16 scale multiplier, f32
    sums); rows of empty slots are 0."""
    del stages
    S, Kp = slot_rows_S.shape[0], x16_RK.shape[1]
    W = words_ENW.shape[2]
    words = jnp.pad(words_ENW[slot_ew_S], ((0, 0), (0, 0), (0, Kp // 8 - W)))  # [S, N, Kp/8]
    vals = jnp.stack(decode_words(words), axis=-1)  # [S, N, Kp/8, 8]
    sbytes = jax.lax.bitcast_convert_type(sexp_ENQ[slot_es_S], jnp.uint8).reshape(*words.shape[:2], -1, 4, 4)
    sbytes = jnp.swapaxes(sbytes, -1, -2).reshape(*words.shape[:2], -1)  # natural block order
    mult = jnp.where(sbytes > 0, jnp.exp2(sbytes.astype(jnp.float32) - 15), 0.0)  # [S, N, Kp/32]
    a = (vals * jnp.repeat(mult, 4, axis=-1)[..., None]).astype(jnp.float16).astype(jnp.float32)
    a = a.reshape(*words.shape[:2], Kp // TILE_K, TILE_K)[..., mma_perm()].reshape(*words.shape[:2], Kp)
    x = x16_RK.astype(jnp.float32).reshape(S, block_m, Kp)
    acc = jnp.einsum("snk,smk->snm", a, x, precision="highest")
    return jnp.where((slot_rows_S > 0)[:, None, None], acc, 0.0)


def gate_up_act_reference(
    words_ENW,
    sexp_ENQ,
    rowfac_EN,
    bias_EN,
    x16_RK,
    tok_fac_R,
    slot_ew_S,
    slot_es_S,
    slot_rows_S,
    *,
    block_m: int,
    stages: int,
    swiglu_limit: float,
    swiglu_alpha: float,
    act_scale: float,
):
    """`gate_up_act` in jnp (rows of empty slots hold the biases' activation)."""
    I, E, S = words_ENW.shape[1] // 2, bias_EN.shape[0], slot_rows_S.shape[0]
    acc = grouped_matmul_reference(
        words_ENW, sexp_ENQ, x16_RK, slot_ew_S, slot_es_S, slot_rows_S, block_m=block_m, stages=stages
    )  # [S, 2I, bm]
    h = acc * rowfac_EN[slot_es_S][:, :, None] * tok_fac_R.reshape(S, 1, block_m) + bias_EN[slot_ew_S % E][..., None]
    act = clamped_swiglu(h[:, :I], h[:, I:], swiglu_limit, swiglu_alpha) * act_scale
    rows = jnp.swapaxes(act, 1, 2).reshape(S * block_m, I).astype(jnp.float16)
    return jnp.zeros((S * block_m, _padded(I)), jnp.float16).at[:, act_positions(I)].set(rows)


def down_out_reference(
    words_ENW,
    sexp_ENQ,
    rowfac_EN,
    bias_EN,
    a16_RK,
    w_R,
    slot_ew_S,
    slot_es_S,
    slot_rows_S,
    *,
    act_fac: float,
    block_m: int,
    stages: int,
):
    """`down_out` in jnp (rows of empty slots hold the biases times their routing weight, 0)."""
    N, E, S = words_ENW.shape[1], bias_EN.shape[0], slot_rows_S.shape[0]
    acc = grouped_matmul_reference(
        words_ENW, sexp_ENQ, a16_RK, slot_ew_S, slot_es_S, slot_rows_S, block_m=block_m, stages=stages
    )  # [S, N, bm]
    y = acc * rowfac_EN[slot_es_S][:, :, None] * act_fac + bias_EN[slot_ew_S % E][..., None]
    return jnp.swapaxes(y, 1, 2).reshape(S * block_m, N) * w_R[:, None]


# ----------------------------------------------------------------------------------------------
# Dispatch, glue and the entry point


def slot_rows(slot_start_S, slot_rows_S, P: int, block_m: int):
    """For each slot row `[S, block_m]`: the sorted pair it holds (P where none), and for each sorted pair
    `[P]`: its row in the flattened slot buffers."""
    r = jnp.arange(block_m, dtype=jnp.int32)
    held = jnp.where(r[None, :] < slot_rows_S[:, None], slot_start_S[:, None] + r[None, :], P)
    flat = jnp.arange(held.size, dtype=jnp.int32)
    where = jnp.zeros((P + 1,), jnp.int32).at[held.reshape(-1)].set(flat)[:P]
    return held, where


@functools.partial(jax.jit, static_argnames=("swiglu_limit", "swiglu_alpha", "block_m", "stages", "interpret"))
def experts(
    x_TD,
    idx_TK,
    w_TK,
    kexp: KernelExperts,
    layer=None,
    valid_TK=None,
    *,
    swiglu_limit,
    swiglu_alpha,
    block_m=16,
    stages=2,
    interpret=None,
):
    """`moe_gemv.experts`'s contract (sum over the routed experts, `[T, D]`) on the Mosaic kernels;
    `interpret` (default: off the GPU) runs the kernels' jnp references instead."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if not fits(kexp.dn_words.shape[-2], kexp.gu_words.shape[-2]):
        raise ValueError(
            f"moe_mosaic: experts with D={kexp.dn_words.shape[-2]}, I={kexp.gu_words.shape[-2]} do "
            f"not tile (D and I multiples of {TILE_N}, both >= {TILE_K}); use moe_mma"
        )
    if not 0 < swiglu_limit < 2**6:
        raise ValueError(f"moe_mosaic: swiglu_limit={swiglu_limit} must be in (0, 64): it bounds the f16 activation")
    gate_up, down = (gate_up_act_reference, down_out_reference) if interpret else (gate_up_act, down_out)
    T, k = idx_TK.shape
    P = T * k
    E, _, I, W = kexp.gu_words.shape[-4:]
    D = x_TD.shape[1]
    tok, w_sorted, order, slot_e, slot_start, rows = moe_slots.slots(idx_TK, w_TK, valid_TK, E, block_m)
    held, where = slot_rows(slot_start, rows, P, block_m)
    one = lambda a: a if layer is None else a[layer]  # this layer's small per-expert tables
    gu_words = kexp.gu_words.reshape(-1, 2 * I, W)  # [L E, 2I, D/8]: gate rows, then up rows
    dn_words = kexp.dn_words.reshape(-1, D, I // 8)
    ew = slot_e if layer is None else slot_e + layer * E
    if kexp.gu_sexp is None:  # not stored: derive this layer's from the E8M0 scales, indexed by expert
        gu_sexp, gu_rowfac, dn_sexp, dn_rowfac = scale_operands(one(kexp.gu_scales), one(kexp.dn_scales))
        es = slot_e
    else:  # stored for every layer: index the stacked arrays, as the words (no per-layer slice copy)
        gu_sexp, dn_sexp = (a.reshape(-1, *a.shape[-2:]) for a in (kexp.gu_sexp, kexp.dn_sexp))  # [L E, N, Q]
        gu_rowfac, dn_rowfac = (a.reshape(-1, a.shape[-1]) for a in (kexp.gu_rowfac, kexp.dn_rowfac))  # [L E, N]
        es = ew

    gu_bias = one(kexp.gu_bias).reshape(E, 2 * I).astype(jnp.float32)  # [E, 2I]: by ew % E
    dn_bias = one(kexp.dn_bias).astype(jnp.float32)  # [E, D]
    kern = dict(block_m=block_m, stages=stages)

    # Each token's f16 operand row is encoded once (the MMA-order permutation is a slow gather in XLA), then
    # copied to its slot rows; padding rows copy token 0 (finite; their outputs are never read).
    x16_T, tok_fac_T = f16_operand(x_TD)
    row_pair = held.reshape(-1)  # [S bm]
    row_tok = jnp.append(tok, 0)[row_pair]
    x16, tok_fac = x16_T[row_tok], tok_fac_T[row_tok]

    # gate and up, SwiGLU: the activation lands in the down's operand layout, scaled by a fixed power of two
    a_exp = act_exponent(swiglu_limit)
    a16 = gate_up(
        gu_words,
        gu_sexp,
        gu_rowfac,
        gu_bias,
        x16,
        tok_fac,
        ew,
        es,
        rows,
        swiglu_limit=swiglu_limit,
        swiglu_alpha=swiglu_alpha,
        act_scale=2.0**a_exp,
        **kern,
    )  # [S bm, Kp(I)]

    # down, biases and routing weights: token rows [S bm, D]
    y = down(
        dn_words,
        dn_sexp,
        dn_rowfac,
        dn_bias,
        a16,
        jnp.append(w_sorted, 0.0)[row_pair],
        ew,
        es,
        rows,
        act_fac=2.0**-a_exp,
        **kern,
    )
    return moe_slots.combine(y[where], order, valid_TK, T, k, x_TD.dtype)
