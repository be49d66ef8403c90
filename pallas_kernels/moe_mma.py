"""MoE for mid-size batches as two Pallas-Triton tensor-core kernels over the re-encoded MXFP4 experts
(`expert_format`), where Mosaic GPU does not run (before Hopper; fp32 models): decoded weights scaled per element,
rounded to bf16 (exact) and fed to `dot` per phase (8 dots of K = block_k / 8), f32 accumulation. Pairs come from
`moe_slots` (sorted by expert, slots of `block_m`); grid `(slots, feature tiles)`, an empty slot exits at once.
Kernel A (gate_up) ends with bias + clamped SwiGLU and writes the activation in kernel B's phase order; kernel B
(down) ends with bias x routing weight. Backend and interpret mode as `moe_gemv`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import layer_index, moe_slots
from pallas_kernels.expert_format import (
    F16_SHIFT,
    KernelExperts,
    clamped_swiglu,
    decode_words,
    flatten_layers,
    scale_f32,
    to_phases,
)


def dot_t(a, b):
    """a [M, K] @ b[N, K]^T in f32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _mm(x, w, swap):
    """x [M, K] tokens, w [N, K] decoded weights -> f32 [M, N] (swap=False) or [N, M] (swap=True).

    swap puts the register-decoded weights in the dot's A slot (wgmma takes A from registers, B from
    shared memory) and the tokens in N."""
    return dot_t(w, x) if swap else dot_t(x, w)


def _mma_step(acc, wq, ws, xs, kw, swap):
    """acc += sum_j x_j @ decode_j(wq)^T with wq u32 [bn, kw], ws u8 [bn, kw/4], xs eight [bm, kw]."""
    bn = wq.shape[0]
    scale = jnp.broadcast_to(scale_f32(ws)[:, :, None], (bn, kw // 4, 4)).reshape(bn, kw)
    for j, v in enumerate(decode_words(wq)):
        acc = acc + _mm(xs[j], (v * scale).astype(xs[j].dtype), swap)
    return acc


def _gate_up_mma_kernel(
    slot_e_ref,
    slot_start_ref,
    slot_rows_ref,
    tok_ref,
    x_ref,
    wq_ref,
    ws_ref,
    bias_ref,
    a_ref,
    *,
    bm,
    bn,
    kw,
    W,
    limit,
    alpha,
    swap,
):
    s = pl.program_id(0)
    n0 = pl.multiple_of(pl.program_id(1) * bn, bn)
    rows = slot_rows_ref[s]

    @pl.when(rows > 0)
    def _():
        e = slot_e_ref[s]
        r0 = slot_start_ref[s]
        row_ok = jnp.arange(bm) < rows
        tok = plt.load(tok_ref.at[pl.ds(r0, bm)], mask=row_ok, other=0)

        def body(i, carry):
            c0 = pl.multiple_of(i * kw, kw)
            col_ok = (c0 + jnp.arange(kw)) < W
            g_ok = (c0 // 4 + jnp.arange(kw // 4)) < (W // 4)
            cols = (c0 + jnp.arange(kw))[None, :]
            xs = [
                plt.load(x_ref.at[tok[:, None], jnp.int32(j), cols], mask=row_ok[:, None] & col_ok[None, :], other=0)
                for j in range(8)
            ]
            out = []
            for h, acc in zip((jnp.int32(0), jnp.int32(1)), carry):
                wq = plt.load(wq_ref.at[e, h, pl.ds(n0, bn), pl.ds(c0, kw)], mask=col_ok[None, :], other=0)
                ws = plt.load(ws_ref.at[e, h, pl.ds(n0, bn), pl.ds(c0 // 4, kw // 4)], mask=g_ok[None, :], other=0)
                out.append(_mma_step(acc, wq, ws, xs, kw, swap))
            return tuple(out)

        zero = jnp.zeros((bn, bm) if swap else (bm, bn), jnp.float32)
        acc_g, acc_u = jax.lax.fori_loop(0, pl.cdiv(W, kw), body, (zero, zero))
        if swap:
            acc_g, acc_u = acc_g.T, acc_u.T
        bg = bias_ref[e, jnp.int32(0), pl.ds(n0, bn)].astype(jnp.float32)
        bu = bias_ref[e, jnp.int32(1), pl.ds(n0, bn)].astype(jnp.float32)
        act = clamped_swiglu(
            acc_g * (2.0**F16_SHIFT) + bg[None, :], acc_u * (2.0**F16_SHIFT) + bu[None, :], limit, alpha
        )
        plt.store(a_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], act.astype(a_ref.dtype), mask=row_ok[:, None])


def _down_mma_kernel(
    slot_e_ref, slot_start_ref, slot_rows_ref, w_ref, a_ref, wq_ref, ws_ref, bias_ref, y_ref, *, bm, bn, kw, W, swap
):
    s = pl.program_id(0)
    n0 = pl.multiple_of(pl.program_id(1) * bn, bn)
    rows = slot_rows_ref[s]

    @pl.when(rows > 0)
    def _():
        e = slot_e_ref[s]
        r0 = slot_start_ref[s]
        row_ok = jnp.arange(bm) < rows

        def body(i, acc):
            c0 = pl.multiple_of(i * kw, kw)
            col_ok = (c0 + jnp.arange(kw)) < W
            g_ok = (c0 // 4 + jnp.arange(kw // 4)) < (W // 4)
            xs = [
                plt.load(
                    a_ref.at[pl.ds(r0, bm), jnp.int32(j), pl.ds(c0, kw)],
                    mask=row_ok[:, None] & col_ok[None, :],
                    other=0,
                )
                for j in range(8)
            ]
            wq = plt.load(wq_ref.at[e, pl.ds(n0, bn), pl.ds(c0, kw)], mask=col_ok[None, :], other=0)
            ws = plt.load(ws_ref.at[e, pl.ds(n0, bn), pl.ds(c0 // 4, kw // 4)], mask=g_ok[None, :], other=0)
            return _mma_step(acc, wq, ws, xs, kw, swap)

        acc = jax.lax.fori_loop(0, pl.cdiv(W, kw), body, jnp.zeros((bn, bm) if swap else (bm, bn), jnp.float32))
        if swap:
            acc = acc.T
        b = bias_ref[e, pl.ds(n0, bn)].astype(jnp.float32)
        rw = plt.load(w_ref.at[pl.ds(r0, bm)], mask=row_ok, other=0.0)
        y = (acc * (2.0**F16_SHIFT) + b[None, :]) * rw[:, None]
        plt.store(y_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], y.astype(y_ref.dtype), mask=row_ok[:, None])


_STATIC = (
    "swiglu_limit",
    "swiglu_alpha",
    "block_m",
    "block_n",
    "block_k",
    "block_n_down",
    "num_warps",
    "num_stages",
    "swap",
    "interpret",
)


@functools.partial(jax.jit, static_argnames=_STATIC)
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
    block_n=32,
    block_k=256,
    block_n_down=32,
    num_warps=4,
    num_stages=3,
    swap=False,
    interpret=None,
):
    """`moe_gemv.experts`'s contract on the tensor-core kernels; `block_k` counts weights along K (block_k / 8
    words per step), `swap` puts the decoded weights in the dot's register operand and the tokens in N."""
    T, k = idx_TK.shape
    E = kexp.gu_words.shape[-4]
    tok, w, order, slot_e, slot_start, slot_rows = moe_slots.slots(idx_TK, w_TK, valid_TK, E, block_m)
    if layer is not None:
        kexp, slot_e = flatten_layers(kexp), slot_e + layer_index.value(layer) * E
    _, _, I, _ = kexp.gu_words.shape
    D = kexp.dn_words.shape[1]
    assert D % 32 == 0 and I % 32 == 0 and block_k % 32 == 0
    bn, bn2 = moe_slots.pick_block(I, block_n), moe_slots.pick_block(D, block_n_down)
    P, bm, S, kw = tok.shape[0], block_m, slot_e.shape[0], block_k // 8
    # slots of more than one row may read up to block_m - 1 entries past the last pair; one-row slots never do
    pad = lambda a: a if bm == 1 else jnp.concatenate([a, jnp.zeros((bm,) + a.shape[1:], a.dtype)])  # noqa: E731
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    call = functools.partial(
        pl.pallas_call,
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    )
    # Tensor-core operands in bf16; fp32 models (the exactness mode) keep fp32 operands throughout.
    op_dtype = jnp.float32 if x_TD.dtype == jnp.float32 else jnp.bfloat16
    x8 = to_phases(x_TD.astype(op_dtype))
    a = call(
        functools.partial(
            _gate_up_mma_kernel, bm=bm, bn=bn, kw=kw, W=D // 8, limit=swiglu_limit, alpha=swiglu_alpha, swap=swap
        ),
        grid=(S, I // bn),
        out_shape=jax.ShapeDtypeStruct((P + bm, I), op_dtype),
        name="mxfp4_gate_up_swiglu",
    )(slot_e, slot_start, slot_rows, pad(tok), x8, kexp.gu_words, kexp.gu_scales, kexp.gu_bias)
    y = call(
        functools.partial(_down_mma_kernel, bm=bm, bn=bn2, kw=kw, W=I // 8, swap=swap),
        grid=(S, D // bn2),
        out_shape=jax.ShapeDtypeStruct((P + bm, D), jnp.float32),
        name="mxfp4_down",
    )(slot_e, slot_start, slot_rows, pad(w), a.reshape(P + bm, 8, I // 8), kexp.dn_words, kexp.dn_scales, kexp.dn_bias)
    return moe_slots.combine(y, order, valid_TK, T, k, x_TD.dtype)
