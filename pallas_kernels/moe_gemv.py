"""Decode MoE as two Pallas-Triton GEMV kernels over the re-encoded MXFP4 experts (`expert_format`), grouped by
expert: kernel A (gate_up) ends with bias + clamped SwiGLU and writes the activation in kernel B's phase order,
kernel B (down) ends with bias x routing weight.

Backend: **Pallas-Triton** (`jax.experimental.pallas.triton`), chosen deliberately although it is
deprecated from JAX 0.11: decode MoE is a grouped GEMV over packed words, where what matters is wide coalesced
loads, cheap register-level bit tricks and a fine-grained grid that fills 132 SMs with hundreds of programs.
Triton's per-thread model expresses this directly; Mosaic GPU's warpgroup-level layouts have no
u32 -> nibble -> f16 path in jax 0.11.2 that we could verify without hardware iteration. It runs bit-for-bit in
CPU interpret mode, so CI checks these exact kernels against the references.

Two arithmetic variants (`half`):
* half precision ("gemv16", bf16 models, <= 2 rows per expert on average: the serving decode default): the
  word decoded by inline PTX into f16x2 pairs multiplied by f16x2 activation pairs (HFMA2), one f16 -> f32
  conversion per 8 weights; the section below says why and what it costs in precision.  Off-GPU the same
  arithmetic runs in jnp (inline PTX has no interpreter);
* f32 ("gemv", fp32 models): 3-D tiles `[block_n rows, nb 32-blocks, 4 words]` so that one thread owns whole
  32-element blocks (one 16-byte load); FMAs in f32 into a per-block partial sum and the E8M0 scale applied
  once per block, no tensor cores and no shared-memory round trip; the next K step's tiles are loaded before
  the current one is used (register double buffer).
Pairs come from `moe_slots` (sorted by expert, slots of `block_m`), or, at a few tokens (`run_routed`, the
serving decode), are routed inside the gate/up kernel from the router logits.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
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

# ----------------------------------------------------------------------------------------------
# GEMV kernels (few rows per slot), f32 or half-precision arithmetic
#
# f32 ("gemv", fp32 models): each word's 8 decoded halves are converted to f32 and multiplied in
# f32.  Those conversions (8 per word), not memory, bound it on the H200 (~3.6e12 weights/s).
# Half precision ("gemv16", bf16 models): one inline-PTX block per word decodes the 4 f16x2 pairs,
# multiplies them with 4 f16x2 activation pairs (HFMA2: two weights per instruction), adds the two
# halves and converts once: ~2 ops per weight.  The products are exact in f16 and each word's 8-term
# sum is rounded to f16 (11 bits) before the f32 block sum, so the result carries ~2^-11 relative
# error per word, below the bf16 rounding of the output.  Range: activations enter scaled by a power
# of two so that |x| < 2^14 (per token for the block input; a fixed 2^a_shift for the SwiGLU output,
# bounded by limit * (limit + 1) through the clamp), hence every product is <= 6 and every word sum
# <= 48: no overflow, and products below f16's normal range carry absolute errors < 2^-24 against
# sums of order 1.
#
# Both read activations as `[rows, phases, K/32, 4]` words per 32-block (8 f32 phases, or 4 u32 f16x2
# pairs of phases (j, j + 4)) and scale each row's sum by a per-row factor (2^14 undoes the decode's
# 2^-14; the half path folds its activation scaling into it).


def _gemv_steps(load, n_steps, compute, acc0, prefetch):
    """K loop; with `prefetch` the next step's tiles are loaded before the current ones are used."""
    if not prefetch:
        return jax.lax.fori_loop(0, n_steps, lambda i, acc: compute(load(i), acc), acc0)

    def body(i, carry):
        tiles, acc = carry
        nxt = load(i + 1)
        return nxt, compute(tiles, acc)

    _, acc = jax.lax.fori_loop(0, n_steps, body, (load(0), acc0))
    return acc


_WORD_DOT_PTX = """{
.reg .b32 wd_p0, wd_p1, wd_p2, wd_p3, wd_t0, wd_t1, wd_acc;
.reg .b16 wd_lo, wd_hi;
and.b32 wd_p0, $1, 0x8E008E00;
shl.b32 wd_t0, $1, 3;
and.b32 wd_p1, wd_t0, 0x8E008E00;
shl.b32 wd_t0, $1, 6;
shl.b32 wd_t1, $1, 1;
and.b32 wd_t0, wd_t0, 0x0E000E00;
and.b32 wd_t1, wd_t1, 0x80008000;
or.b32 wd_p2, wd_t0, wd_t1;
shl.b32 wd_t0, $1, 9;
shl.b32 wd_t1, $1, 2;
and.b32 wd_t0, wd_t0, 0x0E000E00;
and.b32 wd_t1, wd_t1, 0x80008000;
or.b32 wd_p3, wd_t0, wd_t1;
mul.rn.f16x2 wd_acc, wd_p0, $2;
fma.rn.f16x2 wd_acc, wd_p1, $3, wd_acc;
fma.rn.f16x2 wd_acc, wd_p2, $4, wd_acc;
fma.rn.f16x2 wd_acc, wd_p3, $5, wd_acc;
mov.b32 {wd_lo, wd_hi}, wd_acc;
add.rn.f16 wd_lo, wd_lo, wd_hi;
cvt.f32.f16 $0, wd_lo;
}"""


def _f16_halves(v):
    """u32 f16x2 -> (low, high) as f32."""
    h = lambda b: jax.lax.bitcast_convert_type(b.astype(jnp.uint16), jnp.float16).astype(jnp.float32)
    return h(v & np.uint32(0xFFFF)), h(v >> np.uint32(16))


def _word_dots(w, xqs, interpret):
    """Per u32 word and row r: sum_j decode_j(w) * x_rj in f16 arithmetic -> f32.  xqs[r]: 4 u32 f16x2
    pairs (phase j low, j + 4 high) shaped like w.  Off-GPU the same arithmetic in jnp (rounded to f16
    after each operation): PTX has no interpreter."""
    if not interpret:  # one asm block per row (Pallas lowers single-result asm only); ptxas shares the decode
        return [
            plt.elementwise_inline_asm(
                _WORD_DOT_PTX,
                args=[w, *xq],
                constraints="=f,r,r,r,r,r",
                pack=1,
                result_shape_dtypes=[jax.ShapeDtypeStruct(w.shape, jnp.float32)],
            )[0]
            for xq in xqs
        ]
    r16 = lambda v: v.astype(jnp.float16).astype(jnp.float32)
    vals = decode_words(w)
    out = []
    for xq in xqs:
        lo, hi = zip(*[_f16_halves(x) for x in xq])
        acc_lo, acc_hi = r16(vals[0] * lo[0]), r16(vals[4] * hi[0])
        for j in range(1, 4):
            acc_lo, acc_hi = r16(vals[j] * lo[j] + acc_lo), r16(vals[j + 4] * hi[j] + acc_hi)
        out.append(r16(acc_lo + acc_hi))
    return out


def _gemv_partials(w, xs, f16, interpret):
    """w u32 [bn, nb, 4]; xs[r]: the row's phase tiles [nb, 4] -> per row, per-block partial sums [bn, nb]."""
    if f16:
        xb = [[jnp.broadcast_to(x[None], w.shape) for x in xq] for xq in xs]
        return [jnp.sum(d, axis=2) for d in _word_dots(w, xb, interpret)]
    vals = decode_words(w)
    out = []
    for x8 in xs:
        p = vals[0] * x8[0][None]
        for j in range(1, 8):
            p = p + vals[j] * x8[j][None]
        out.append(jnp.sum(p, axis=2))
    return out


def half_pairs(x_TK: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[T, K] -> (u32 [T, 4, K/32, 4] f16x2 pairs of phases (j, j + 4) scaled by 2^c_t so |x| < 2^14,
    f32 [T] 2^(14 - c_t): the factor that undoes the scaling and the decode's 2^-14)."""
    T, K = x_TK.shape
    x = x_TK.astype(jnp.float32)
    _, e = jnp.frexp(jnp.max(jnp.abs(x), axis=1))  # amax < 2^e
    x8 = to_phases(jnp.ldexp(x, (14 - e)[:, None]).astype(jnp.float16))  # [T, 8, K/8]
    pairs = jnp.stack([x8[:, :4], x8[:, 4:]], axis=-1)  # [T, 4, K/8, 2]
    words = jax.lax.bitcast_convert_type(pairs, jnp.uint32).reshape(T, 4, K // 32, 4)
    return words, jnp.ldexp(jnp.ones((T,), jnp.float32), e)


def activation_shift(limit: float) -> int:
    """Power of two that maps the clamped SwiGLU output (|a| <= limit * (limit + 1)) below 2^14."""
    return 14 - math.ceil(math.log2(max(limit, 1.0) * (limit + 1.0)))


def _order_flip(b):
    """f32 bits <-> an int32 that orders as the float does, -0.0 below 0.0 as in `lax.top_k` (its own inverse): a
    warp's integer max and min are one instruction each (`redux.sync`), where a float max takes five shuffles."""
    return b ^ ((b >> 31) & 0x7FFFFFFF)


def _routed_pair(logits_ref, layer_ref, map_ref, s, k: int, E: int, warps: int):
    """Pair `s` = token s // k and its (s % k)-th best expert, routed in-kernel from the token's logits
    (`moe_route`): the expert's row in the flat `[L * E]` expert axis, and its softmax weight over the k best as
    `[warps]` equal copies. The largest logit left, then the lowest id holding it: ties go to the lower id, as in
    `lax.top_k`.

    Every program of the pair computes this before its first weight load, so no reduction crosses warps: each warp
    holds all the logits as `[warps, 32]` tiles (lane l of tile c: expert `tiles * l + c`, strided so that the
    loads keep that layout) and reduces integer order keys (`_order_flip`) within itself. Only the expert's id
    crosses warps, once. Reductions over the whole block took 19 barriers and 61 shuffles at 128 experts (120b),
    ~5 us of each layer's 51 us gate/up kernel (BENCHMARKS §34)."""
    row0 = layer_index.read(layer_ref, map_ref) * E  # issued first: its load overlaps the logits'
    n = 1 << (E - 1).bit_length()
    lanes = min(n, 32)
    tiles = n // lanes
    lane = jnp.broadcast_to(jnp.arange(lanes)[None, :], (warps, lanes))
    ids = [tiles * lane + c for c in range(tiles)]
    logits = [plt.load(logits_ref.at[s // k, i], mask=i < E, other=-jnp.inf) for i in ids]
    keys = [_order_flip(jax.lax.bitcast_convert_type(x, jnp.int32)) for x in logits]

    j = s % k
    for i in range(k):  # each reduction: elementwise across tiles, then within each warp -> [warps, 1]
        key = jnp.max(functools.reduce(jnp.maximum, keys), axis=1, keepdims=True)
        where = [jnp.where(x == key, c, n) for x, c in zip(keys, ids)]
        best = jnp.min(functools.reduce(jnp.minimum, where), axis=1, keepdims=True)
        v = jax.lax.bitcast_convert_type(_order_flip(key), jnp.float32)
        if i == 0:
            chosen, value, top, total = best, v, v, jnp.ones_like(v)
        else:
            chosen, value = jnp.where(i == j, best, chosen), jnp.where(i == j, v, value)
            total = total + jnp.exp(v - top)
        keys = [jnp.where(c == best, jnp.iinfo(jnp.int32).min, x) for x, c in zip(keys, ids)]
    weight = (jnp.exp(value - top) / total)[:, 0]
    return row0 + jnp.max(chosen), weight


def _slot_program(slot_refs, route, bm: int, body, routed_out=(), idle=None):
    """Run `body(e, r0, rows, tok, weight)` for this program's slot (`tok(r)`, `weight(r)`: row r's token and
    routing weight). From `dispatch`'s slot arrays, `slot_refs` = (expert, start, rows, per-pair operand: the
    token for gate/up, the weight for down, so both callables read it); with `route` = (k, E, warps) and `slot_refs` =
    (logits, the layer's `layer_index.operands` and `live_operand`), one pair per program (bm = 1), routed
    in-kernel, the program of feature tile 0 storing the pair's expert and weight in `routed_out` (the weight as
    `[warps]` equal copies, a row each pair); with `route` = "pairs", `slot_refs` = those two arrays (column 0 of the
    weights read). A step that is not live (`layer_index.live`) routes no pair: its
    programs store expert -1, and a pair of expert -1 runs `idle(r0)` instead of `body` (the down kernel's zeros)."""
    s = pl.program_id(0)
    if route == "pairs":
        e, w = slot_refs[0][s], slot_refs[1][s, 0]
        pl.when(e >= 0)(lambda: body(e, s, 1, lambda r: s, lambda r: w))
        return pl.when(e < 0)(lambda: idle(s))
    if route is not None:
        live = layer_index.live(slot_refs[3])
        e, w = _routed_pair(*slot_refs[:3], s, *route)

        @pl.when(pl.program_id(1) == 0)
        def _():
            routed_out[0][s] = jnp.where(live, e, -1)
            routed_out[1][s, :] = w

        return pl.when(live)(lambda: body(e, s, 1, lambda r: s // route[0], None))
    slot_e_ref, slot_start_ref, slot_rows_ref, pair_ref = slot_refs
    rows = slot_rows_ref[s]

    @pl.when(rows > 0)
    def _():
        r0 = slot_start_ref[s]
        body(slot_e_ref[s], r0, rows, lambda r: pair_ref[r0 + r], lambda r: pair_ref[r0 + r])


def _gate_up_gemv_kernel(*refs, route, bm, bn, nb, G, I, f16, limit, alpha, a_shift, prefetch, interpret):
    n_out = 1 if route is None else 3  # routed: the pairs' experts and weights too, for the down kernel
    ins, (a_ref, *routed_out) = refs[:-n_out], refs[-n_out:]
    slot_refs, (xs_ref, x_ref, wq_ref, ws_ref, bias_ref) = ins[:-5], ins[-5:]
    n0 = pl.multiple_of(pl.program_id(1) * bn, bn)

    def program(e, r0, rows, tok, _):
        toks = [tok(r) for r in range(bm)]

        def load(i):
            b0 = i * nb
            ok = (b0 + jnp.arange(nb)) < G
            w = [
                plt.load(wq_ref.at[e, h, pl.ds(n0, bn), pl.ds(b0, nb), :], mask=ok[None, :, None], other=0)
                for h in (jnp.int32(0), jnp.int32(1))
            ]
            sc = [
                plt.load(ws_ref.at[e, h, pl.ds(n0, bn), pl.ds(b0, nb)], mask=ok[None, :], other=0)
                for h in (jnp.int32(0), jnp.int32(1))
            ]
            x = [
                [
                    plt.load(x_ref.at[toks[r], jnp.int32(j), pl.ds(b0, nb), :], mask=ok[:, None] & (r < rows), other=0)
                    for j in range(x_ref.shape[1])
                ]
                for r in range(bm)
            ]
            return w, sc, x

        def compute(tiles, acc):
            w, sc, x = tiles
            out = []
            for h in range(2):
                scale = scale_f32(sc[h])
                out.append([a + d * scale for a, d in zip(acc[h], _gemv_partials(w[h], x, f16, interpret))])
            return out

        zero = jnp.zeros((bn, nb), jnp.float32)
        acc = _gemv_steps(load, pl.cdiv(G, nb), compute, [[zero] * bm, [zero] * bm], prefetch)
        bg = bias_ref[e, jnp.int32(0), pl.ds(n0, bn)].astype(jnp.float32)
        bu = bias_ref[e, jnp.int32(1), pl.ds(n0, bn)].astype(jnp.float32)
        if f16:  # phase-order row c goes to f16 column 2 (c mod I/2) + (c >= I/2): u32 pairs of phases (j, j + 4)
            upper = (n0 >= I // 2).astype(jnp.int32)
            cols = 2 * (n0 - upper * (I // 2) + jnp.arange(bn)) + upper
        else:
            cols = n0 + jnp.arange(bn)
        for r in range(bm):
            xs = xs_ref[toks[r]]
            act = clamped_swiglu(
                jnp.sum(acc[0][r], axis=1) * xs + bg, jnp.sum(acc[1][r], axis=1) * xs + bu, limit, alpha
            )
            plt.store(a_ref.at[r0 + r, cols], (act * 2.0**a_shift).astype(a_ref.dtype), mask=jnp.full((bn,), r < rows))

    _slot_program(slot_refs, route, bm, program, routed_out)


def _down_gemv_kernel(*refs, route, bm, bn, nb, G, f16, out_scale, prefetch, interpret):
    slot_refs, (a_ref, wq_ref, ws_ref, bias_ref, y_ref) = refs[:-5], refs[-5:]
    n0 = pl.multiple_of(pl.program_id(1) * bn, bn)

    def program(e, r0, rows, _, weight):

        def load(i):
            b0 = i * nb
            ok = (b0 + jnp.arange(nb)) < G
            w = plt.load(wq_ref.at[e, pl.ds(n0, bn), pl.ds(b0, nb), :], mask=ok[None, :, None], other=0)
            sc = plt.load(ws_ref.at[e, pl.ds(n0, bn), pl.ds(b0, nb)], mask=ok[None, :], other=0)
            a = [
                [
                    plt.load(a_ref.at[r0 + r, jnp.int32(j), pl.ds(b0, nb), :], mask=ok[:, None] & (r < rows), other=0)
                    for j in range(a_ref.shape[1])
                ]
                for r in range(bm)
            ]
            return w, sc, a

        def compute(tiles, acc):
            w, sc, a = tiles
            scale = scale_f32(sc)
            return [c + d * scale for c, d in zip(acc, _gemv_partials(w, a, f16, interpret))]

        acc = _gemv_steps(load, pl.cdiv(G, nb), compute, [jnp.zeros((bn, nb), jnp.float32)] * bm, prefetch)
        b = bias_ref[e, pl.ds(n0, bn)].astype(jnp.float32)
        for r in range(bm):
            y = (jnp.sum(acc[r], axis=1) * out_scale + b) * weight(r)
            plt.store(y_ref.at[r0 + r, pl.ds(n0, bn)], y, mask=jnp.full((bn,), r < rows))

    def idle(r0):  # a pair that is not routed (a step that is not live): zeros for the MoE's back end
        y_ref[r0, pl.ds(n0, bn)] = jnp.zeros((bn,), jnp.float32)

    _slot_program(slot_refs, route, bm, program, idle=idle)


def _run_gemv(
    call,
    x,
    xs,
    gate_slots,
    down_slots,
    S: int,
    kexp: KernelExperts,
    *,
    route,
    R,
    f16,
    swiglu_limit,
    swiglu_alpha,
    block_m,
    block_n,
    block_k,
    block_n_down,
    prefetch,
    prefetch_down,
    interpret,
):
    """The two GEMV kernels over S slots (`_slot_program`: `gate_slots` / `down_slots` are their slot operands;
    routed, the down kernel reads the pairs the gate/up kernel routed) and the activation operand (`x` words,
    per-token factors `xs`: `half_pairs` for f16, f32 phases and 2^14 otherwise); returns y [R, D] f32 in slot
    order."""
    E, _, I, _ = kexp.gu_words.shape
    D = kexp.dn_words.shape[1]
    bm = block_m
    bn, bn2, nb = moe_slots.pick_block(I // 2, block_n), moe_slots.pick_block(D, block_n_down), block_k // 32
    a_shift, a_dtype = (activation_shift(swiglu_limit), jnp.float16) if f16 else (0, jnp.float32)
    kern = dict(bm=bm, f16=f16, interpret=interpret)
    out_shape = [jax.ShapeDtypeStruct((R, I), a_dtype)]
    if route is not None:
        out_shape += [jax.ShapeDtypeStruct((S,), jnp.int32), jax.ShapeDtypeStruct((S, route[2]), jnp.float32)]
    a, *pairs = call(
        functools.partial(
            _gate_up_gemv_kernel,
            bn=bn,
            nb=nb,
            G=D // 32,
            I=I,
            limit=swiglu_limit,
            alpha=swiglu_alpha,
            a_shift=a_shift,
            route=route,
            prefetch=prefetch,
            **kern,
        ),
        grid=(S, I // bn),
        out_shape=out_shape,
        name="mxfp4_gate_up_swiglu_gemv16" if f16 else "mxfp4_gate_up_swiglu_gemv",
    )(*gate_slots, xs, x, kexp.gu_words.reshape(E, 2, I, D // 32, 4), kexp.gu_scales, kexp.gu_bias)
    if f16:
        a = jax.lax.bitcast_convert_type(a.reshape(R, I // 2, 2), jnp.uint32).reshape(R, 4, I // 32, 4)
    else:
        a = a.reshape(R, 8, I // 32, 4)
    return call(
        functools.partial(
            _down_gemv_kernel,
            bn=bn2,
            nb=nb,
            G=I // 32,
            out_scale=2.0 ** (F16_SHIFT - a_shift),
            route=None if route is None else "pairs",
            prefetch=prefetch_down,
            **kern,
        ),
        grid=(S, D // bn2),
        out_shape=jax.ShapeDtypeStruct((R, D), jnp.float32),
        name="mxfp4_down_gemv16" if f16 else "mxfp4_down_gemv",
    )(*(pairs or down_slots), a, kexp.dn_words.reshape(E, D, I // 32, 4), kexp.dn_scales, kexp.dn_bias)


def run_routed(
    words,
    xs,
    logits_TE,
    layer,
    kexp_flat: KernelExperts,
    *,
    top_k: int,
    swiglu_limit,
    swiglu_alpha,
    block_n,
    block_k,
    block_n_down,
    num_warps,
    num_stages,
    prefetch,
    prefetch_down,
    interpret=None,
):
    """The `gemv16` kernels routing in-kernel (`_routed_pair`): one program row per (token, k-th best expert)
    pair, read from the router logits `[T, E]` of layer `layer` (traced) of the flat `[L * E]` experts by the
    gate/up kernel, which hands each pair's expert and weight to the down kernel; `words`, `xs`: `half_pairs` of
    the normed tokens. Returns y `[T * k, D]` f32, pairs in token order."""
    T, E = logits_TE.shape
    P = T * top_k
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    call = functools.partial(
        pl.pallas_call,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )
    slots = (logits_TE, *layer_index.operands(layer), layer_index.live_operand(layer))
    return _run_gemv(
        call,
        words,
        xs,
        slots,
        None,
        P,
        kexp_flat,
        route=(top_k, E, num_warps),
        R=P,
        f16=True,
        swiglu_limit=swiglu_limit,
        swiglu_alpha=swiglu_alpha,
        block_m=1,
        block_n=block_n,
        block_k=block_k,
        block_n_down=block_n_down,
        prefetch=prefetch,
        prefetch_down=prefetch_down,
        interpret=interpret,
    )


_STATIC = (
    "swiglu_limit",
    "swiglu_alpha",
    "half",
    "block_m",
    "block_n",
    "block_k",
    "block_n_down",
    "num_warps",
    "num_stages",
    "prefetch",
    "prefetch_down",
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
    half=True,
    block_m=1,
    block_n=16,
    block_k=512,
    block_n_down=16,
    num_warps=4,
    num_stages=1,
    prefetch=False,
    prefetch_down=True,
    interpret=None,
):
    """The expert math for given routing, `sum_k w[t,k] * expert_{idx[t,k]}(x[t])` -> `[T, D]`: the contract of
    every MoE kernel module's `experts`. With `layer` (traced), `kexp` carries a leading layer axis, viewed as one
    flat expert axis, so no layer slice is copied. Pairs outside `valid_TK` (bool) cost no expert work and add 0
    (expert parallelism: pairs routed to another device's experts). `half`: the f16 arithmetic ("gemv16") or f32.
    `block_k` counts weights along K (block_k / 32 blocks per step)."""
    T, k = idx_TK.shape
    E, D = kexp.gu_words.shape[-4], kexp.dn_words.shape[-2]
    tok, w, order, slot_e, slot_start, slot_rows = moe_slots.slots(idx_TK, w_TK, valid_TK, E, block_m)
    if layer is not None:
        kexp, slot_e = flatten_layers(kexp), slot_e + layer_index.value(layer) * E
    # slots of more than one row may read up to block_m - 1 entries past the last pair; one-row slots never do
    pad = lambda a: a if block_m == 1 else jnp.concatenate([a, jnp.zeros((block_m,) + a.shape[1:], a.dtype)])  # noqa: E731
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    call = functools.partial(
        pl.pallas_call,
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    )
    operand = (
        half_pairs(x_TD)
        if half
        else (
            to_phases(x_TD.astype(jnp.float32)).reshape(-1, 8, D // 32, 4),
            jnp.full(x_TD.shape[:1], 2.0**F16_SHIFT, jnp.float32),
        )
    )
    y = _run_gemv(
        call,
        *operand,
        (slot_e, slot_start, slot_rows, pad(tok)),
        (slot_e, slot_start, slot_rows, pad(w)),
        slot_e.shape[0],
        kexp,
        route=None,
        R=tok.shape[0] + block_m,
        f16=half,
        swiglu_limit=swiglu_limit,
        swiglu_alpha=swiglu_alpha,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        block_n_down=block_n_down,
        prefetch=prefetch,
        prefetch_down=prefetch_down,
        interpret=interpret,
    )
    return moe_slots.combine(y, order, valid_TK, T, k, x_TD.dtype)
