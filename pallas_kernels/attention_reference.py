"""Pure-JAX attention with learned sinks, GQA and an optional sliding window (the reference path).

Materialises the full `[queries, keys]` logits, so it is for correctness and small shapes; the
Pallas kernels beside it must compute the same function.
"""

import jax
import jax.numpy as jnp


def attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, sinks_N: jax.Array,
              q_pos_BT: jax.Array, window: jax.Array | int) -> jax.Array:
    """Causal attention of queries at absolute positions `q_pos_BT` over a contiguous cache whose slot
    `j` holds the key at position `j`. A query at position `p` sees keys `p-window+1 .. p`.

    Each head's sink logit joins the softmax denominator only, so probabilities sum to less than 1
    and a row with no visible key yields 0.
    """
    B, T, N, H = q_BTNH.shape
    S, K = k_BSKH.shape[1], k_BSKH.shape[2]
    G = N // K
    q = q_BTNH.reshape(B, T, K, G, H)
    logits = jnp.einsum("btkgh,bskh->bkgts", q, k_BSKH, preferred_element_type=jnp.float32)
    logits = logits * (H ** -0.5)
    kv_pos = jnp.arange(S)
    qp = q_pos_BT[:, None, None, :, None]
    visible = (kv_pos <= qp) & (qp - kv_pos < window)
    logits = jnp.where(visible, logits, -jnp.inf)
    sinks = sinks_N.astype(jnp.float32).reshape(1, K, G, 1, 1)
    m = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), sinks)
    p = jnp.exp(logits - m)
    denom = jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(sinks - m)
    p = p / denom
    out = jnp.einsum("bkgts,bskh->btkgh", p, v_BSKH.astype(jnp.float32))
    return out.reshape(B, T, N, H).astype(q_BTNH.dtype)
