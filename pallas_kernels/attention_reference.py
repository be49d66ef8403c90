"""Pure-JAX paged attention with learned sinks, GQA and an optional sliding window (the reference).

Keys and values live in a page pool read through a per-row block table (docs/engine.md, "Kernel
interface"). The reference gathers the visible pages into a contiguous `[B, keys]` view and
materialises the full logits, so it is for correctness and modest shapes; the Pallas kernels beside
it must compute the same function. For a sliding window it gathers only the pages that can hold a
visible key, so sliding layers cost O(window), not O(context).
"""

import jax
import jax.numpy as jnp

from pallas_kernels import kv_quant


def _visible_pages(block_tables_BM: jax.Array, q_pos_BT: jax.Array, page_size: int, window: int, T: int):
    """Block-table columns `[B, n]` a row's queries can see: all of them for full attention, else the
    `n` columns covering `[first query - window + 1, last query]` (queries are consecutive)."""
    B, M = block_tables_BM.shape
    n = min(M, (T + window + page_size - 3) // page_size + 1)
    if n == M:
        return jnp.broadcast_to(jnp.arange(M), (B, M))
    first_q = jnp.min(jnp.where(q_pos_BT >= 0, q_pos_BT, jnp.iinfo(jnp.int32).max), axis=1)
    start = jnp.clip((first_q - window + 1) // page_size, 0, M - n)
    return start[:, None] + jnp.arange(n)


def attention(
    q_BTNH: jax.Array,
    k_pages_PSKH: jax.Array,
    v_pages: jax.Array,
    block_tables_BM: jax.Array,
    q_pos_BT: jax.Array,
    sinks_N: jax.Array,
    window: int,
    *,
    k_scale_PKS: jax.Array | None = None,
    v_scale_PKS: jax.Array | None = None,
    return_sink_mass: bool = False,
):
    """Causal attention of queries at absolute positions `q_pos_BT` (-1 = padding) over paged keys.

    A query at position `p` sees keys `p-window+1 .. p`. Each head's sink logit joins the softmax
    denominator only, so probabilities sum to less than 1 and a row with no visible key yields 0.
    `return_sink_mass` (static; for inspection) also returns the probability each head gives its sink,
    `[B, T, N]` fp32 = 1 - (mass on the keys); padded queries give 1. The values are laid out as the keys,
    `[P, S, K, H]`, except in an FP8 pool: `[P, K, H, S]` (`kv_quant`), with the per-(slot, head) scales
    `k_scale_PKS`/`v_scale_PKS` (laid out `[P, K, S]`): the scores are the dots with the stored values times the
    key's scale, and the values are weighted by the probability times the value's scale, as the kernels do.
    """
    B, T, N, H = q_BTNH.shape
    S, K = k_pages_PSKH.shape[1], k_pages_PSKH.shape[2]
    G = N // K
    cols_Bn = _visible_pages(block_tables_BM, q_pos_BT, S, window, T)
    pages_Bn = jnp.take_along_axis(block_tables_BM, cols_Bn, axis=1)
    n = cols_Bn.shape[1]
    k_BJKH = k_pages_PSKH[pages_Bn].reshape(B, n * S, K, H)
    v_BnSKH = v_pages[pages_Bn] if v_scale_PKS is None else kv_quant.values_PSKH(v_pages[pages_Bn])
    v_BJKH = v_BnSKH.reshape(B, n * S, K, H)
    kv_pos_BJ = (cols_Bn[:, :, None] * S + jnp.arange(S)).reshape(B, n * S)

    q = q_BTNH.reshape(B, T, K, G, H)
    logits = jnp.einsum("btkgh,bjkh->bkgtj", q, k_BJKH.astype(q.dtype), preferred_element_type=jnp.float32)
    logits = logits * (H**-0.5)
    scale_BKJ = lambda a: a[pages_Bn].transpose(0, 2, 1, 3).reshape(B, K, n * S)  # noqa: E731
    if k_scale_PKS is not None:
        logits = logits * scale_BKJ(k_scale_PKS)[:, :, None, None, :]
    qp = q_pos_BT[:, None, None, :, None]
    kp = kv_pos_BJ[:, None, None, None, :]
    visible = (kp <= qp) & (qp - kp < window)
    logits = jnp.where(visible, logits, -jnp.inf)
    sinks = sinks_N.astype(jnp.float32).reshape(1, K, G, 1, 1)
    m = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), sinks)
    p = jnp.exp(logits - m)
    denom = jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(sinks - m)
    p = p / denom
    pv = p
    if v_scale_PKS is not None:
        pv = p * scale_BKJ(v_scale_PKS)[:, :, None, None, :]
    out = jnp.einsum("bkgtj,bjkh->btkgh", pv, v_BJKH.astype(jnp.float32))
    out = out.reshape(B, T, N, H).astype(q_BTNH.dtype)
    if not return_sink_mass:
        return out
    sink_BKGT = (jnp.exp(sinks - m) / denom)[..., 0]
    return out, sink_BKGT.transpose(0, 3, 1, 2).reshape(B, T, N)
