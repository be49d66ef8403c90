"""The experts' MXFP4 weights re-encoded for the kernels (`KernelExperts`), and their in-kernel decoding.

Weight encoding (`prepare_experts`, once at load, same 4 bits per weight): each u32 word holds the
8 consecutive weights `8q .. 8q+7` of a row, re-packed so that two weights `j` and `j+4` decode
together into an f16x2 word (`(sign << 15) | (mag << 9)` per half: an exact f16 of e2m1 * 2^-14,
subnormals included) with 1-5 integer ops: `w & M`, `(w << 3) & M`, and two shift/mask pairs.
That is ~1.6 ops per weight instead of ~4 for the checkpoint's nibble order.  Activations are fed
in the matching "phase" order `x8[t, j, m] = x[t, 8m + j]`. The gate/up rows are stored in phase order
too, so the gate/up kernels write their activation already in the down kernels' K order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

F16_SHIFT = 14  # decoded f16 halves are e2m1 * 2^-14

# Bit position of each of the 8 weights of a word: magnitude (3 bits) and sign.
MAG_POS = (9, 6, 3, 0, 25, 22, 19, 16)
SIGN_POS = (15, 12, 14, 13, 31, 28, 30, 29)
_M_BOTH, _M_MAG, _M_SIGN = np.uint32(0x8E008E00), np.uint32(0x0E000E00), np.uint32(0x80008000)


@struct.dataclass
class KernelExperts:
    """One layer's experts re-encoded for the kernels (same 4 bits per weight as `params.Experts`)."""

    gu_words: jax.Array  # u32 [E, 2, I, D/8]  [:, 0] gate, [:, 1] up; rows in phase order
    gu_scales: jax.Array  # u8  [E, 2, I, D/32]
    gu_bias: jax.Array  #     [E, 2, I]
    dn_words: jax.Array  # u32 [E, D, I/8]
    dn_scales: jax.Array  # u8  [E, D, I/32]
    dn_bias: jax.Array  #     [E, D]
    # The Mosaic GPU kernels' scale operands (`moe_mosaic.scale_operands`), stored by
    # `pallas_kernels.prepare_params` where the Mosaic kernels run (bf16 models on Hopper); None elsewhere.
    gu_sexp: jax.Array | None = None  # u32 [E, 2I, Gp/4] (Gp: D/32 padded to whole K steps)
    gu_rowfac: jax.Array | None = None  # f32 [E, 2I]
    dn_sexp: jax.Array | None = None  # u32 [E, D, Gp/4]
    dn_rowfac: jax.Array | None = None  # f32 [E, D]
    # The experts dequantized to bf16 once (`moe_dense.dequantize_experts`: values x 2^-14, features in natural
    # order), stored by `pallas_kernels.prepare_params` with `KernelConfig.moe_prefill_bf16_experts` where the
    # grouped prefill GEMMs run (bf16 models of up to 32 experts on Hopper), which then read them instead of
    # dequantizing per call; None elsewhere.
    gu_bf16: jax.Array | None = None  # bf16 [E, 2I, D]: the gate rows, then the up rows
    dn_bf16: jax.Array | None = None  # bf16 [E, D, I]


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
KERNEL_FIELDS = {
    "gate_up_blocks": "gu_words",
    "gate_up_scales": "gu_scales",
    "gate_up_bias": "gu_bias",
    "down_blocks": "dn_words",
    "down_scales": "dn_scales",
    "down_bias": "dn_bias",
}


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
    a = a.reshape(*a.shape[: lead + 1], I, 2, *a.shape[lead + 2 :])
    return jnp.take(jnp.moveaxis(a, lead + 2, lead + 1), jnp.asarray(phase_order(I)), axis=lead + 2)


def flatten_layers(kexp: KernelExperts) -> KernelExperts:
    """Experts stacked over layers `[L, E, ...]` as one flat expert axis `[L * E, ...]` (a free view): the kernels
    then find layer `l`'s expert `e` at `l * E + e`, so no layer's experts are copied out first."""
    return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), kexp)


def prepare_experts(experts) -> KernelExperts:
    """Re-encoding + relayout of `params.Experts` (one layer, or stacked on a leading layer axis)."""
    return KernelExperts(**{k: relayout_field(n, getattr(experts, n)) for n, k in KERNEL_FIELDS.items()})


# ----------------------------------------------------------------------------------------------
# In-kernel decoding, shared by every kernel that reads the encoding


def decode_words(w):
    """u32 words (any shape) -> the 8 weights of each word as f32 (e2m1 * 2^-14), j = 0..7."""
    pairs = (
        w & _M_BOTH,
        (w << 3) & _M_BOTH,
        ((w << 6) & _M_MAG) | ((w << 1) & _M_SIGN),
        ((w << 9) & _M_MAG) | ((w << 2) & _M_SIGN),
    )

    def half(v):
        return jax.lax.bitcast_convert_type(v.astype(jnp.uint16), jnp.float16).astype(jnp.float32)

    return [half(p & np.uint32(0xFFFF)) for p in pairs] + [half(p >> np.uint32(16)) for p in pairs]


def scale_f32(s_u8):
    """E8M0 -> f32 2^(s-127) by placing s in the exponent field (s = 0 gives 0)."""
    return jax.lax.bitcast_convert_type(s_u8.astype(jnp.uint32) << 23, jnp.float32)


def clamped_swiglu(g, u, limit, alpha):
    """gpt-oss's SwiGLU on separate gate and up values (`moe_reference.swiglu` takes them interleaved)."""
    g = jnp.minimum(g, limit)
    u = jnp.minimum(jnp.maximum(u, -limit), limit)
    return g * (1.0 / (1.0 + jnp.exp(-alpha * g))) * (u + 1.0)
