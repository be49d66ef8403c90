"""Pure-JAX MXFP4 mixture-of-experts (the reference path): top-k routing and clamped SwiGLU experts.

Two regimes, picked statically from the token count:
* few tokens (`tokens * top_k <= experts`): gather only the routed experts' packed weights and
  dequantise those, so a decode step reads 4 experts per token, not all of them. (`lax.ragged_dot`
  is avoided on purpose: on the GPU it streams every expert.)
* many tokens: scan over experts, dequantising one expert at a time (memory bounded by one expert)
  and applying it to all tokens with their routing weight (zero where not routed).
"""

import jax
import jax.numpy as jnp

from pallas_kernels import mxfp4


def route(x_TD: jax.Array, router_w_ED: jax.Array, router_b_E: jax.Array, top_k: int):
    """Top-k expert ids `[T, k]` and their weights: softmax over the k selected logits only."""
    logits = jnp.einsum("td,ed->te", x_TD, router_w_ED, preferred_element_type=jnp.float32)
    logits = logits + router_b_E.astype(jnp.float32)
    vals, idx = jax.lax.top_k(logits, top_k)
    return idx, jax.nn.softmax(vals, axis=-1), logits


def swiglu(z: jax.Array, limit: float, alpha: float) -> jax.Array:
    """gpt-oss's clamped SwiGLU on interleaved `[..., 2I]` (gate = even, up = odd): gate clamped above
    only, up clamped both sides, and the up branch gets +1."""
    g = jnp.minimum(z[..., 0::2], limit)
    u = jnp.clip(z[..., 1::2], -limit, limit)
    return g * jax.nn.sigmoid(alpha * g) * (u + 1.0)


def moe(
    x_TD: jax.Array,
    router_w_ED: jax.Array,
    router_b_E: jax.Array,
    experts,
    *,
    top_k: int,
    swiglu_limit: float,
    swiglu_alpha: float,
) -> jax.Array:
    """`experts` is a `params.Experts` of one layer (no leading layer axis). Returns `[T, D]`."""
    idx_TK, w_TK, _ = route(x_TD, router_w_ED, router_b_E, top_k)
    y = apply_experts(x_TD, idx_TK, w_TK, experts, swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha)
    return y.astype(x_TD.dtype)


def apply_experts(
    x_TD: jax.Array, idx_TK: jax.Array, w_TK: jax.Array, experts, *, swiglu_limit: float, swiglu_alpha: float
) -> jax.Array:
    """`sum_k w[t, k] * expert_{idx[t, k]}(x[t])` in fp32. Entries with weight 0 contribute nothing,
    which is how expert parallelism masks the experts another device holds."""
    T, _ = x_TD.shape
    E = experts.gate_up_blocks.shape[0]
    top_k = idx_TK.shape[1]
    dtype = x_TD.dtype
    f32 = jnp.float32

    if T * top_k <= E:
        gu = mxfp4.dequantize(experts.gate_up_blocks[idx_TK], experts.gate_up_scales[idx_TK], dtype)
        z = jnp.einsum("td,tkod->tko", x_TD, gu, preferred_element_type=f32)
        z = z + experts.gate_up_bias[idx_TK].astype(f32)
        a = swiglu(z, swiglu_limit, swiglu_alpha).astype(dtype)
        dn = mxfp4.dequantize(experts.down_blocks[idx_TK], experts.down_scales[idx_TK], dtype)
        y = jnp.einsum("tki,tkdi->tkd", a, dn, preferred_element_type=f32)
        y = y + experts.down_bias[idx_TK].astype(f32)
        return jnp.einsum("tkd,tk->td", y, w_TK)

    def one_expert(acc_TD, e):
        gu = mxfp4.dequantize(experts.gate_up_blocks[e], experts.gate_up_scales[e], dtype)
        z = jnp.einsum("td,od->to", x_TD, gu, preferred_element_type=f32)
        z = z + experts.gate_up_bias[e].astype(f32)
        a = swiglu(z, swiglu_limit, swiglu_alpha).astype(dtype)
        dn = mxfp4.dequantize(experts.down_blocks[e], experts.down_scales[e], dtype)
        y = jnp.einsum("ti,di->td", a, dn, preferred_element_type=f32) + experts.down_bias[e].astype(f32)
        w_T = jnp.sum(jnp.where(idx_TK == e, w_TK, 0.0), axis=-1)
        return acc_TD + w_T[:, None] * y, None

    acc, _ = jax.lax.scan(one_expert, jnp.zeros(x_TD.shape, f32), jnp.arange(E))
    return acc
