"""Fused MXFP4 mixture-of-experts as two Pallas kernels (grouped by expert), with the decode entry.

Backend: **Pallas-Triton** (`jax.experimental.pallas.triton`), chosen deliberately although it is
deprecated from JAX 0.11:
* decode MoE is a grouped GEMV over packed words: what matters is wide coalesced loads, cheap
  register-level bit tricks and a fine-grained grid that fills 132 SMs with hundreds of programs.
  Triton's per-thread model expresses this directly; Mosaic GPU's warpgroup-level layouts have no
  u32 -> nibble -> f16 path in jax 0.11.2 that we could verify without hardware iteration;
* the same module with large row tiles is the prefill grouped GEMM (`dot` -> Hopper wgmma);
* it runs bit-for-bit in CPU interpret mode, so CI checks these exact kernels against the
  references (Mosaic GPU's interpreter covers a subset of its own primitives only).

Weight encoding (`prepare_experts`, once at load, same 4 bits per weight): each u32 word holds the
8 consecutive weights `8q .. 8q+7` of a row, re-packed so that two weights `j` and `j+4` decode
together into an f16x2 word (`(sign << 15) | (mag << 9)` per half: an exact f16 of e2m1 * 2^-14,
subnormals included) with 1-5 integer ops: `w & M`, `(w << 3) & M`, and two shift/mask pairs.
That is ~1.6 ops per weight instead of ~4 for the checkpoint's nibble order.  Activations are fed
in the matching "phase" order `x8[t, j, m] = x[t, 8m + j]`.

Three kernel families on that encoding (`kernel=` in the config):
* "gemv16" (bf16 models, <= 2 rows per expert on average: the serving decode default): the GEMV below
  with the word decoded by inline PTX into f16x2 pairs multiplied by f16x2 activation pairs (HFMA2),
  one f16 -> f32 conversion per 8 weights; section "Half-precision GEMV kernels" says why and what it
  costs in precision.  Off-GPU the same arithmetic runs in jnp (inline PTX has no interpreter);
* "gemv" (f32 GEMV, fp32 models): 3-D tiles `[block_n rows, nb 32-blocks, 4 words]` so that
  one thread owns whole 32-element blocks (one 16-byte load); FMAs in f32 into a per-block partial
  sum and the E8M0 scale applied once per block, no tensor cores and no shared-memory round trip;
  the next K step's tiles are loaded before the current one is used (register double buffer).
* "mma" (many rows, prefill): decoded weights scaled per element, rounded to bf16 (exact) and fed to
  `dot` per phase (8 dots of K = block_k / 8), f32 accumulation.
Both: routing stays in JAX, (token, expert) pairs are sorted by expert and cut into slots of at
most `block_m` pairs; grid `(slots, feature tiles)`, an empty slot exits at once.  Kernel A
(gate_up) ends with bias + clamped SwiGLU and writes the activation already in kernel B's phase
order (the gate/up rows are permuted at load); kernel B (down) ends with bias x routing weight.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import moe_reference

F16_SHIFT = 14  # decoded f16 halves are e2m1 * 2^-14

# Bit position of each of the 8 weights of a word: magnitude (3 bits) and sign.
MAG_POS = (9, 6, 3, 0, 25, 22, 19, 16)
SIGN_POS = (15, 12, 14, 13, 31, 28, 30, 29)
_M_BOTH, _M_MAG, _M_SIGN = np.uint32(0x8E008E00), np.uint32(0x0E000E00), np.uint32(0x80008000)


@struct.dataclass
class KernelExperts:
    """One layer's experts re-encoded for the kernels (same 4 bits per weight as `params.Experts`)."""
    gu_words: jax.Array   # u32 [E, 2, I, D/8]  [:, 0] gate, [:, 1] up; rows in phase order
    gu_scales: jax.Array  # u8  [E, 2, I, D/32]
    gu_bias: jax.Array    #     [E, 2, I]
    dn_words: jax.Array   # u32 [E, D, I/8]
    dn_scales: jax.Array  # u8  [E, D, I/32]
    dn_bias: jax.Array    #     [E, D]
    # The Mosaic GPU kernels' scale operands (`moe_mosaic.scale_operands`), stored by
    # `pallas_kernels.prepare_params` on Hopper for bf16 models; None elsewhere.
    gu_sexp: jax.Array | None = None    # u32 [E, 2I, Gp/4] (Gp: D/32 padded to whole K steps)
    gu_rowfac: jax.Array | None = None  # f32 [E, 2I]
    dn_sexp: jax.Array | None = None    # u32 [E, D, Gp/4]
    dn_rowfac: jax.Array | None = None  # f32 [E, D]


def phase_order(n: int) -> np.ndarray:
    """Feature order in which kernel A writes the activation: column c holds feature 8 (c % n/8) + c // (n/8)."""
    c = np.arange(n)
    return 8 * (c % (n // 8)) + c // (n // 8)


def to_phases(x_TK: jax.Array) -> jax.Array:
    """[T, K] -> [T, 8, K/8] with [t, j, m] = x[t, 8m + j] (the order the word decode yields)."""
    T, K = x_TK.shape
    return x_TK.reshape(T, K // 8, 8).transpose(0, 2, 1)


def encode_words(blocks_u8: jax.Array) -> jax.Array:
    """Checkpoint bytes [..., G, 16] (low nibble first) -> re-packed u32 words [..., G*4]."""
    w = jax.lax.bitcast_convert_type(blocks_u8.reshape(*blocks_u8.shape[:-1], 4, 4), jnp.uint32)
    w = w.reshape(*blocks_u8.shape[:-2], -1)
    out = jnp.zeros_like(w)
    for j in range(8):
        c = w >> (4 * j)
        out = out | ((c & 7) << MAG_POS[j]) | (((c >> 3) & 1) << SIGN_POS[j])
    return out


# Each kernel field is made from one checkpoint field, so the loader relayouts tensor by tensor, layer
# by layer, and never holds the experts twice.
KERNEL_FIELDS = {"gate_up_blocks": "gu_words", "gate_up_scales": "gu_scales", "gate_up_bias": "gu_bias",
                 "down_blocks": "dn_words", "down_scales": "dn_scales", "down_bias": "dn_bias"}


def relayout_field(name: str, a: jax.Array) -> jax.Array:
    """One `params.Experts` field `name` (any leading axes before the expert axis) in kernel layout."""
    if name.startswith("down"):
        return encode_words(a) if name == "down_blocks" else a
    if name == "gate_up_blocks":
        a = encode_words(a)
    # [..., E, 2I, *t] -> [..., E, 2, I, *t]: gate = even rows, up = odd rows, features in phase order
    ntrail = {"gate_up_blocks": 1, "gate_up_scales": 1, "gate_up_bias": 0}[name]
    lead = a.ndim - 2 - ntrail
    I = a.shape[lead + 1] // 2
    a = a.reshape(*a.shape[:lead + 1], I, 2, *a.shape[lead + 2:])
    return jnp.take(jnp.moveaxis(a, lead + 2, lead + 1), jnp.asarray(phase_order(I)), axis=lead + 2)


def prepare_experts(experts) -> KernelExperts:
    """Re-encoding + relayout of `params.Experts` (one layer, or stacked on a leading layer axis)."""
    return KernelExperts(**{k: relayout_field(n, getattr(experts, n)) for n, k in KERNEL_FIELDS.items()})


# ----------------------------------------------------------------------------------------------
# In-kernel decoding


def _decode_words(w):
    """u32 words (any shape) -> the 8 weights of each word as f32 (e2m1 * 2^-14), j = 0..7."""
    pairs = (w & _M_BOTH, (w << 3) & _M_BOTH,
             ((w << 6) & _M_MAG) | ((w << 1) & _M_SIGN),
             ((w << 9) & _M_MAG) | ((w << 2) & _M_SIGN))

    def half(v):
        return jax.lax.bitcast_convert_type(v.astype(jnp.uint16), jnp.float16).astype(jnp.float32)

    return [half(p & np.uint32(0xFFFF)) for p in pairs] + [half(p >> np.uint32(16)) for p in pairs]


def _scale_f32(s_u8):
    """E8M0 -> f32 2^(s-127) by placing s in the exponent field (s = 0 gives 0)."""
    return jax.lax.bitcast_convert_type(s_u8.astype(jnp.uint32) << 23, jnp.float32)


def _swiglu(g, u, limit, alpha):
    g = jnp.minimum(g, limit)
    u = jnp.minimum(jnp.maximum(u, -limit), limit)
    return g * (1.0 / (1.0 + jnp.exp(-alpha * g))) * (u + 1.0)


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
        return [plt.elementwise_inline_asm(_WORD_DOT_PTX, args=[w, *xq], constraints="=f,r,r,r,r,r", pack=1,
                                           result_shape_dtypes=[jax.ShapeDtypeStruct(w.shape, jnp.float32)])[0]
                for xq in xqs]
    r16 = lambda v: v.astype(jnp.float16).astype(jnp.float32)
    vals = _decode_words(w)
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
    vals = _decode_words(w)
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
    pairs = jnp.stack([x8[:, :4], x8[:, 4:]], axis=-1)                  # [T, 4, K/8, 2]
    words = jax.lax.bitcast_convert_type(pairs, jnp.uint32).reshape(T, 4, K // 32, 4)
    return words, jnp.ldexp(jnp.ones((T,), jnp.float32), e)


def activation_shift(limit: float) -> int:
    """Power of two that maps the clamped SwiGLU output (|a| <= limit * (limit + 1)) below 2^14."""
    return 14 - math.ceil(math.log2(max(limit, 1.0) * (limit + 1.0)))


def _routed_pair(logits_ref, layer_ref, s, k: int, E: int):
    """Pair `s` = token s // k and its (s % k)-th best expert, routed in-kernel from the token's logits
    (`moe_route`): the expert's row in the flat `[L * E]` expert axis and its softmax weight over the k best.
    Repeated argmax takes ties in lower-id order, as `lax.top_k` does."""
    ids = jnp.arange(1 << (E - 1).bit_length())
    logits = plt.load(logits_ref.at[s // k, pl.ds(0, ids.shape[0])], mask=ids < E, other=-jnp.inf)
    top, j = jnp.max(logits), s % k
    chosen, value, total = jnp.int32(0), top, jnp.float32(0.0)
    for i in range(k):
        best, v = jnp.argmax(logits).astype(jnp.int32), jnp.max(logits)
        chosen, value = jnp.where(i == j, best, chosen), jnp.where(i == j, v, value)
        total = total + jnp.exp(v - top)
        logits = jnp.where(ids == best, -jnp.inf, logits)
    return layer_ref[0] * E + chosen, jnp.exp(value - top) / total


def _slot_program(slot_refs, route, bm: int, body, routed_out=()):
    """Run `body(e, r0, rows, tok, weight)` for this program's slot (`tok(r)`, `weight(r)`: row r's token and
    routing weight). From `dispatch`'s slot arrays, `slot_refs` = (expert, start, rows, per-pair operand: the
    token for gate/up, the weight for down, so both callables read it); with `route` = (k, E) and `slot_refs` =
    (logits, layer), one pair per program (bm = 1), routed in-kernel, the program of feature tile 0 storing the
    pair's expert and weight in `routed_out`; with `route` = "pairs", `slot_refs` = those two arrays."""
    s = pl.program_id(0)
    if route == "pairs":
        w = slot_refs[1][s]
        return body(slot_refs[0][s], s, 1, lambda r: s, lambda r: w)
    if route is not None:
        e, w = _routed_pair(*slot_refs, s, *route)

        @pl.when(pl.program_id(1) == 0)
        def _():
            routed_out[0][s] = e
            routed_out[1][s] = w

        return body(e, s, 1, lambda r: s // route[0], lambda r: w)
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
            w = [plt.load(wq_ref.at[e, h, pl.ds(n0, bn), pl.ds(b0, nb), :], mask=ok[None, :, None], other=0)
                 for h in (jnp.int32(0), jnp.int32(1))]
            sc = [plt.load(ws_ref.at[e, h, pl.ds(n0, bn), pl.ds(b0, nb)], mask=ok[None, :], other=0)
                  for h in (jnp.int32(0), jnp.int32(1))]
            x = [[plt.load(x_ref.at[toks[r], jnp.int32(j), pl.ds(b0, nb), :], mask=ok[:, None] & (r < rows),
                           other=0) for j in range(x_ref.shape[1])] for r in range(bm)]
            return w, sc, x

        def compute(tiles, acc):
            w, sc, x = tiles
            out = []
            for h in range(2):
                scale = _scale_f32(sc[h])
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
            act = _swiglu(jnp.sum(acc[0][r], axis=1) * xs + bg, jnp.sum(acc[1][r], axis=1) * xs + bu, limit, alpha)
            plt.store(a_ref.at[r0 + r, cols], (act * 2.0 ** a_shift).astype(a_ref.dtype),
                      mask=jnp.full((bn,), r < rows))

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
            a = [[plt.load(a_ref.at[r0 + r, jnp.int32(j), pl.ds(b0, nb), :], mask=ok[:, None] & (r < rows),
                           other=0) for j in range(a_ref.shape[1])] for r in range(bm)]
            return w, sc, a

        def compute(tiles, acc):
            w, sc, a = tiles
            scale = _scale_f32(sc)
            return [c + d * scale for c, d in zip(acc, _gemv_partials(w, a, f16, interpret))]

        acc = _gemv_steps(load, pl.cdiv(G, nb), compute, [jnp.zeros((bn, nb), jnp.float32)] * bm, prefetch)
        b = bias_ref[e, pl.ds(n0, bn)].astype(jnp.float32)
        for r in range(bm):
            y = (jnp.sum(acc[r], axis=1) * out_scale + b) * weight(r)
            plt.store(y_ref.at[r0 + r, pl.ds(n0, bn)], y, mask=jnp.full((bn,), r < rows))

    _slot_program(slot_refs, route, bm, program)


def _run_gemv(call, x, xs, gate_slots, down_slots, S: int, kexp: KernelExperts, *, route, R, f16, swiglu_limit,
              swiglu_alpha, block_m, block_n, block_k, block_n_down, prefetch, prefetch_down, interpret):
    """The two GEMV kernels over S slots (`_slot_program`: `gate_slots` / `down_slots` are their slot operands;
    routed, the down kernel reads the pairs the gate/up kernel routed) and the activation operand (`x` words,
    per-token factors `xs`: `half_pairs` for f16, f32 phases and 2^14 otherwise); returns y [R, D] f32 in slot
    order."""
    E, _, I, _ = kexp.gu_words.shape
    D = kexp.dn_words.shape[1]
    bm = block_m
    bn, bn2, nb = _pick_bn(I // 2, block_n), _pick_bn(D, block_n_down), block_k // 32
    a_shift, a_dtype = (activation_shift(swiglu_limit), jnp.float16) if f16 else (0, jnp.float32)
    kern = dict(bm=bm, f16=f16, interpret=interpret)
    out_shape = [jax.ShapeDtypeStruct((R, I), a_dtype)]
    if route is not None:
        out_shape += [jax.ShapeDtypeStruct((S,), jnp.int32), jax.ShapeDtypeStruct((S,), jnp.float32)]
    a, *pairs = call(functools.partial(_gate_up_gemv_kernel, bn=bn, nb=nb, G=D // 32, I=I, limit=swiglu_limit,
                                       alpha=swiglu_alpha, a_shift=a_shift, route=route, prefetch=prefetch, **kern),
                     grid=(S, I // bn), out_shape=out_shape,
                     name="mxfp4_gate_up_swiglu_gemv16" if f16 else "mxfp4_gate_up_swiglu_gemv",
                     )(*gate_slots, xs, x, kexp.gu_words.reshape(E, 2, I, D // 32, 4), kexp.gu_scales, kexp.gu_bias)
    if f16:
        a = jax.lax.bitcast_convert_type(a.reshape(R, I // 2, 2), jnp.uint32).reshape(R, 4, I // 32, 4)
    else:
        a = a.reshape(R, 8, I // 32, 4)
    return call(functools.partial(_down_gemv_kernel, bn=bn2, nb=nb, G=I // 32, out_scale=2.0 ** (F16_SHIFT - a_shift),
                                  route=None if route is None else "pairs", prefetch=prefetch_down, **kern),
                grid=(S, D // bn2), out_shape=jax.ShapeDtypeStruct((R, D), jnp.float32),
                name="mxfp4_down_gemv16" if f16 else "mxfp4_down_gemv",
                )(*(pairs or down_slots), a, kexp.dn_words.reshape(E, D, I // 32, 4), kexp.dn_scales, kexp.dn_bias)


def run_routed(words, xs, logits_TE, layer, kexp_flat: KernelExperts, *, top_k: int, swiglu_limit, swiglu_alpha,
               block_n, block_k, block_n_down, num_warps, num_stages, prefetch, prefetch_down, interpret=None, **_):
    """The `gemv16` kernels routing in-kernel (`_routed_pair`): one program row per (token, k-th best expert)
    pair, read from the router logits `[T, E]` of layer `layer` (traced) of the flat `[L * E]` experts by the
    gate/up kernel, which hands each pair's expert and weight to the down kernel; `words`, `xs`: `half_pairs` of
    the normed tokens. Returns y `[T * k, D]` f32, pairs in token order.
    Takes `decode_config`'s gemv16 settings (`**_`: its kernel and block_m)."""
    T, E = logits_TE.shape
    P = T * top_k
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    call = functools.partial(pl.pallas_call, compiler_params=plt.CompilerParams(num_warps=num_warps,
                                                                                num_stages=num_stages),
                             interpret=interpret)
    slots = (logits_TE, jnp.asarray(layer, jnp.int32).reshape(1))
    return _run_gemv(call, words, xs, slots, None, P, kexp_flat, route=(top_k, E), R=P, f16=True,
                     swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha, block_m=1, block_n=block_n,
                     block_k=block_k, block_n_down=block_n_down, prefetch=prefetch, prefetch_down=prefetch_down,
                     interpret=interpret)


# ----------------------------------------------------------------------------------------------
# MMA kernels (many rows per slot)


def _dot_t(a, b):
    """a [M, K] @ b[N, K]^T in f32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _mm(x, w, swap):
    """x [M, K] tokens, w [N, K] decoded weights -> f32 [M, N] (swap=False) or [N, M] (swap=True).

    swap puts the register-decoded weights in the dot's A slot (wgmma takes A from registers, B from
    shared memory) and the tokens in N."""
    return _dot_t(w, x) if swap else _dot_t(x, w)


def _mma_step(acc, wq, ws, xs, kw, swap):
    """acc += sum_j x_j @ decode_j(wq)^T with wq u32 [bn, kw], ws u8 [bn, kw/4], xs eight [bm, kw]."""
    bn = wq.shape[0]
    scale = jnp.broadcast_to(_scale_f32(ws)[:, :, None], (bn, kw // 4, 4)).reshape(bn, kw)
    for j, v in enumerate(_decode_words(wq)):
        acc = acc + _mm(xs[j], (v * scale).astype(xs[j].dtype), swap)
    return acc


def _gate_up_mma_kernel(slot_e_ref, slot_start_ref, slot_rows_ref, tok_ref, x_ref, wq_ref, ws_ref,
                        bias_ref, a_ref, *, bm, bn, kw, W, limit, alpha, swap):
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
            xs = [plt.load(x_ref.at[tok[:, None], jnp.int32(j), cols], mask=row_ok[:, None] & col_ok[None, :],
                           other=0) for j in range(8)]
            out = []
            for h, acc in zip((jnp.int32(0), jnp.int32(1)), carry):
                wq = plt.load(wq_ref.at[e, h, pl.ds(n0, bn), pl.ds(c0, kw)], mask=col_ok[None, :], other=0)
                ws = plt.load(ws_ref.at[e, h, pl.ds(n0, bn), pl.ds(c0 // 4, kw // 4)],
                              mask=g_ok[None, :], other=0)
                out.append(_mma_step(acc, wq, ws, xs, kw, swap))
            return tuple(out)

        zero = jnp.zeros((bn, bm) if swap else (bm, bn), jnp.float32)
        acc_g, acc_u = jax.lax.fori_loop(0, pl.cdiv(W, kw), body, (zero, zero))
        if swap:
            acc_g, acc_u = acc_g.T, acc_u.T
        bg = bias_ref[e, jnp.int32(0), pl.ds(n0, bn)].astype(jnp.float32)
        bu = bias_ref[e, jnp.int32(1), pl.ds(n0, bn)].astype(jnp.float32)
        act = _swiglu(acc_g * (2.0 ** F16_SHIFT) + bg[None, :], acc_u * (2.0 ** F16_SHIFT) + bu[None, :],
                      limit, alpha)
        plt.store(a_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], act.astype(a_ref.dtype), mask=row_ok[:, None])


def _down_mma_kernel(slot_e_ref, slot_start_ref, slot_rows_ref, w_ref, a_ref, wq_ref, ws_ref, bias_ref,
                     y_ref, *, bm, bn, kw, W, swap):
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
            xs = [plt.load(a_ref.at[pl.ds(r0, bm), jnp.int32(j), pl.ds(c0, kw)],
                           mask=row_ok[:, None] & col_ok[None, :], other=0) for j in range(8)]
            wq = plt.load(wq_ref.at[e, pl.ds(n0, bn), pl.ds(c0, kw)], mask=col_ok[None, :], other=0)
            ws = plt.load(ws_ref.at[e, pl.ds(n0, bn), pl.ds(c0 // 4, kw // 4)], mask=g_ok[None, :], other=0)
            return _mma_step(acc, wq, ws, xs, kw, swap)

        acc = jax.lax.fori_loop(0, pl.cdiv(W, kw), body,
                                jnp.zeros((bn, bm) if swap else (bm, bn), jnp.float32))
        if swap:
            acc = acc.T
        b = bias_ref[e, pl.ds(n0, bn)].astype(jnp.float32)
        rw = plt.load(w_ref.at[pl.ds(r0, bm)], mask=row_ok, other=0.0)
        y = (acc * (2.0 ** F16_SHIFT) + b[None, :]) * rw[:, None]
        plt.store(y_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], y.astype(y_ref.dtype), mask=row_ok[:, None])


# ----------------------------------------------------------------------------------------------
# Dispatch (JAX)


def _pick_bn(n: int, want: int, least: int = 8) -> int:
    """The largest power-of-two halving of `want` (>= `least`) that divides the feature size `n`."""
    b = want
    while b > least and n % b:
        b //= 2
    if n % b:
        raise ValueError(f"feature size {n} is not a multiple of {least}")
    return b


def dispatch(idx_TK: jax.Array, w_TK: jax.Array, num_experts: int, block_m: int):
    """Sort (token, expert) pairs by expert and cut them into slots of <= block_m pairs.

    Returns (tok_sorted [P], w_sorted [P] f32, order [P], slot_expert [S], slot_start [S],
    slot_rows [S]) with S = P // block_m + min(E, P) a static bound on the slot count.  Every step
    is a single fusion or sort (no while loops: `searchsorted` by comparison, not bisection).
    """
    T, k = idx_TK.shape
    P, E = T * k, num_experts
    e_flat = idx_TK.reshape(P).astype(jnp.int32)
    order = jnp.argsort(e_flat, stable=True).astype(jnp.int32)
    tok_sorted = order // k
    w_sorted = w_TK.reshape(P).astype(jnp.float32)[order]
    counts = jnp.zeros((E,), jnp.int32).at[e_flat].add(1)
    starts = jnp.cumsum(counts) - counts
    nchunks = (counts + block_m - 1) // block_m
    chunk_end = jnp.cumsum(nchunks)
    S = P // block_m + min(E, P)
    s = jnp.arange(S, dtype=jnp.int32)
    slot_e = jnp.searchsorted(chunk_end, s, side="right", method="compare_all").astype(jnp.int32)
    e_c = jnp.minimum(slot_e, E - 1)
    j = s - (chunk_end[e_c] - nchunks[e_c])
    rows = jnp.where(slot_e < E, jnp.clip(counts[e_c] - j * block_m, 0, block_m), 0)
    start = starts[e_c] + j * block_m
    return tok_sorted, w_sorted, order, e_c, start.astype(jnp.int32), rows.astype(jnp.int32)


_STATIC = ("swiglu_limit", "swiglu_alpha", "kernel", "block_m", "block_n", "block_k", "block_n_down",
           "num_warps", "num_stages", "swap", "prefetch", "prefetch_down", "interpret")


def run_kernels(x_TD, tok_sorted, w_sorted, slot_e, slot_start, slot_rows, kexp: KernelExperts, *,
                swiglu_limit, swiglu_alpha, kernel, block_m, block_n, block_k, block_n_down, num_warps,
                num_stages, swap=False, prefetch=True, prefetch_down=True, interpret=None):
    """The two Pallas kernels on dispatched pairs; returns y [P + block_m, D] f32 in sorted order.

    block_k counts weights along K (gemv: block_k / 32 blocks per step; mma: block_k / 8 words)."""
    E, _, I, _ = kexp.gu_words.shape
    D = kexp.dn_words.shape[1]
    P = tok_sorted.shape[0]
    bm = block_m
    bn = _pick_bn(I, block_n)
    bn2 = _pick_bn(D, block_n_down)
    assert D % 32 == 0 and I % 32 == 0 and block_k % 32 == 0
    S = slot_e.shape[0]
    # slots of bm > 1 rows may read up to bm - 1 entries past the last pair; one-row slots never do
    pad = lambda a: a if bm == 1 else jnp.concatenate([a, jnp.zeros((bm,) + a.shape[1:], a.dtype)])
    tok_p, w_p = pad(tok_sorted), pad(w_sorted)
    params = plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    call = functools.partial(pl.pallas_call, compiler_params=params, interpret=interpret)

    if kernel in ("gemv", "gemv16"):
        operand = half_pairs(x_TD) if kernel == "gemv16" else (
            to_phases(x_TD.astype(jnp.float32)).reshape(-1, 8, D // 32, 4),
            jnp.full(x_TD.shape[:1], 2.0 ** F16_SHIFT, jnp.float32))
        return _run_gemv(call, *operand, (slot_e, slot_start, slot_rows, tok_p), (slot_e, slot_start, slot_rows, w_p),
                         S, kexp, route=None, R=P + bm, f16=kernel == "gemv16", swiglu_limit=swiglu_limit,
                         swiglu_alpha=swiglu_alpha, block_m=bm, block_n=block_n, block_k=block_k,
                         block_n_down=block_n_down, prefetch=prefetch, prefetch_down=prefetch_down,
                         interpret=interpret)

    kw = block_k // 8
    # Tensor-core operands in bf16; fp32 models (the exactness mode) keep fp32 operands throughout.
    op_dtype = jnp.float32 if x_TD.dtype == jnp.float32 else jnp.bfloat16
    x8 = to_phases(x_TD.astype(op_dtype))
    a = call(functools.partial(_gate_up_mma_kernel, bm=bm, bn=bn, kw=kw, W=D // 8, limit=swiglu_limit,
                               alpha=swiglu_alpha, swap=swap),
             grid=(S, I // bn), out_shape=jax.ShapeDtypeStruct((P + bm, I), op_dtype),
             name="mxfp4_gate_up_swiglu",
             )(slot_e, slot_start, slot_rows, tok_p, x8, kexp.gu_words, kexp.gu_scales, kexp.gu_bias)
    return call(functools.partial(_down_mma_kernel, bm=bm, bn=bn2, kw=kw, W=I // 8, swap=swap),
                grid=(S, D // bn2), out_shape=jax.ShapeDtypeStruct((P + bm, D), jnp.float32),
                name="mxfp4_down",
                )(slot_e, slot_start, slot_rows, w_p, a.reshape(P + bm, 8, I // 8), kexp.dn_words,
                  kexp.dn_scales, kexp.dn_bias)


@functools.partial(jax.jit, static_argnames=_STATIC)
def experts_forward(x_TD, idx_TK, w_TK, kexp: KernelExperts, layer=None, valid_TK=None, *, swiglu_limit,
                    swiglu_alpha, kernel="gemv", block_m=1, block_n=16, block_k=256, block_n_down=16, num_warps=4,
                    num_stages=1, swap=False, prefetch=True, prefetch_down=True, interpret=None):
    """The expert math for given routing: sum_k w[t,k] * expert_{idx[t,k]}(x[t]) -> [T, D].

    With `layer` (traced), `kexp` carries a leading layer axis: it is viewed as one flat expert axis
    (a free reshape) and the slots point at that layer's experts, so no layer slice is copied.
    `valid_TK` (bool) marks the pairs to compute; the others cost no expert work and contribute 0
    (expert parallelism: pairs routed to another device's experts, rows of a receive buffer that
    nothing arrived in)."""
    T, k = idx_TK.shape
    E = kexp.gu_words.shape[-4]
    tok_sorted, w_sorted, order, slot_e, slot_start, slot_rows = slots(idx_TK, w_TK, valid_TK, E, block_m)
    if layer is not None:
        kexp = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), kexp)
        slot_e = slot_e + layer * E
    y = run_kernels(x_TD, tok_sorted, w_sorted, slot_e, slot_start, slot_rows, kexp,
                    swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha, kernel=kernel,
                    block_m=block_m, block_n=block_n, block_k=block_k, block_n_down=block_n_down,
                    num_warps=num_warps, num_stages=num_stages, swap=swap, prefetch=prefetch,
                    prefetch_down=prefetch_down, interpret=interpret)
    return combine(y, order, valid_TK, T, k, x_TD.dtype)


def slots(idx_TK, w_TK, valid_TK, E: int, block_m: int):
    """(token, expert) pairs -> `dispatch`'s slots; `block_m` 1 keeps token order (nothing to sort or permute
    back: `order` None). Pairs outside `valid_TK` get no slot."""
    P = idx_TK.size
    if block_m == 1:
        pairs = jnp.arange(P, dtype=jnp.int32)
        rows = jnp.ones((P,), jnp.int32) if valid_TK is None else valid_TK.reshape(P).astype(jnp.int32)
        return (pairs // idx_TK.shape[1], w_TK.reshape(P).astype(jnp.float32), None,
                idx_TK.reshape(P).astype(jnp.int32), pairs, rows)
    routed = idx_TK if valid_TK is None else jnp.where(valid_TK, idx_TK, E)  # id E: sorted last, in no slot
    tok, w, order, slot_e, start, rows = dispatch(routed, w_TK, E, block_m)
    return tok, w, order, slot_e.astype(jnp.int32), start, rows


def combine(y_RD, order, valid_TK, T: int, k: int, dtype):
    """Kernel rows (slot order, >= T * k of them) -> `[T, D]`: back to pair order, skipped pairs zeroed,
    summed over the k experts of each token."""
    P = T * k
    y = y_RD[:P] if order is None else y_RD[jnp.zeros((P,), jnp.int32).at[order].set(jnp.arange(P, dtype=jnp.int32))]
    if valid_TK is not None:  # rows of skipped pairs were never written
        y = jnp.where(valid_TK.reshape(P, 1), y, 0.0)
    return jnp.sum(y.reshape(T, k, -1), axis=1).astype(dtype)


def decode_config(T: int, k: int, E: int, half: bool = False) -> dict:
    """Kernel and block sizes below the dense regime (`moe_prefill.DENSE_ROWS`), best of the H200 sweeps
    (docs/kernels.md).  bf16 models (`half`): the half-precision GEMV, one pair per slot, while experts
    average <= 2 routed rows; fp32 models: the f32 GEMV while they average <= 1.  Register double
    buffering pays only for a single token, and in the half-precision GEMV only in the down kernel (the
    gate/up kernel's doubled tiles cost more occupancy than they hide latency: docs/BENCHMARKS.md §7d).
    Beyond that, tensor cores amortise the decode over the rows of a slot."""
    if half and T * k <= 2 * E:
        return dict(kernel="gemv16", block_m=1, block_n=16, block_k=512 if T == 1 else 1024, block_n_down=16,
                    num_warps=4, num_stages=1, prefetch=False, prefetch_down=T == 1)
    if not half and T * k <= E:
        return dict(kernel="gemv", block_m=1, block_n=16, block_k=512, block_n_down=16, num_warps=4,
                    num_stages=1, prefetch=T == 1, prefetch_down=T == 1)
    bm = 16
    while bm < 64 and bm < 2 * T * k / E:
        bm *= 2
    if bm == 64:  # >= 16 rows per expert: wider feature tiles, decoded weights as the register operand
        return dict(kernel="mma", block_m=64, block_n=64, block_k=128, block_n_down=64, num_warps=4, num_stages=3,
                    swap=True)
    return dict(kernel="mma", block_m=bm, block_n=32, block_k=256, block_n_down=32, num_warps=4,
                num_stages=3)


def moe(x_TD, router_w_ED, router_b_E, kexp: KernelExperts, *, top_k, swiglu_limit, swiglu_alpha,
        layer=None, interpret=None, **config):
    """Drop-in for `moe_reference.moe` (decode regime), taking `prepare_experts(experts)`."""
    T = x_TD.shape[0]
    E = router_w_ED.shape[0]
    idx, w, _ = moe_reference.route(x_TD, router_w_ED, router_b_E, top_k)
    cfg = decode_config(T, top_k, E, half=x_TD.dtype != jnp.float32)
    cfg.update(config)
    return experts_forward(x_TD, idx, w, kexp, layer, swiglu_limit=float(swiglu_limit),
                           swiglu_alpha=float(swiglu_alpha), interpret=interpret, **cfg)
