"""Decode attention (one query per row) over a paged KV cache: GQA-packed, split along the sequence,
learned sinks, and sliding layers that visit only the pages of the last `window` keys.

Backend: **Pallas-Triton** (`jax.experimental.pallas.triton`), deprecated from JAX 0.11 but chosen
on purpose:
* the kernel is a gather: each step reads `block_kv / page_size` pages named by the block table.
  Triton pointer tensors express a page gather as one 2-D load, and its software pipeliner keeps
  several such loads in flight; Mosaic GPU wants TMA descriptors over dense tiles, and a per-page
  TMA issue loop with mbarriers could not be brought up without hardware iteration here;
* it runs in CPU interpret mode, so CI tests this exact kernel.

Design: grid `(batch, kv_heads, splits)`.  One program owns one KV head of one row, so each K/V
page slice is read once for all its `G = N // K` query heads (the G queries are the rows of the
`[16, H]` q tile: padded to 16 so `dot` maps to tensor cores).  The visible key range
`[max(0, p - window + 1), p]` is cut into `block_kv`-key blocks; split `s` takes an equal share of
those blocks, so a sliding layer touches at most `ceil(window / block_kv) + 1` blocks whatever the
context, and a full layer spreads a long context over `splits` programs.  Each program keeps an
online softmax in fp32 and writes (acc, max, sum); a tiny JAX epilogue merges the splits and adds
the sink to the denominator: out = sum_s e^(m_s - M) acc_s / (sum_s e^(m_s - M) l_s + e^(sink - M)).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

NEG = -1e30


def _kernel(bt_ref, lo_ref, hi_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, page_size,
            pages_per_block, num_splits, max_pages, scale):
    b = pl.program_id(0)
    kh = pl.program_id(1)
    sp = pl.program_id(2)
    bkv = page_size * pages_per_block
    lo = lo_ref[b]
    hi = hi_ref[b]
    blk_lo = lo // bkv
    blk_hi = (hi + bkv - 1) // bkv
    nblk = jnp.maximum(blk_hi - blk_lo, 0)
    per = (nblk + num_splits - 1) // num_splits
    first = blk_lo + sp * per
    last = jnp.minimum(first + per, blk_hi)

    gp, H = q_ref.shape[2], q_ref.shape[3]
    q = q_ref[b, kh, :, :]  # [gp, H]
    hcols = jnp.arange(H)[None, :]

    def body(blk, carry):
        m, l, acc = carry
        cols = blk * pages_per_block + jnp.arange(pages_per_block)
        pages = plt.load(bt_ref.at[b, pl.ds(blk * pages_per_block, pages_per_block)],
                         mask=cols < max_pages, other=0)
        pos = blk * bkv + jnp.arange(bkv)
        ok = (pos >= lo) & (pos < hi)
        rows = (pages[:, None] * page_size + jnp.arange(page_size)[None, :]).reshape(bkv)
        k = plt.load(k_ref.at[rows[:, None], kh, hcols], mask=ok[:, None], other=0)
        v = plt.load(v_ref.at[rows[:, None], kh, hcols], mask=ok[:, None], other=0)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * scale  # [gp, bkv]
        s = jnp.where(ok[None, :], s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        p = jnp.where(ok[None, :], p, 0.0)
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, l, acc

    m0 = jnp.full((gp,), NEG, jnp.float32)
    l0 = jnp.zeros((gp,), jnp.float32)
    a0 = jnp.zeros((gp, H), jnp.float32)
    m, l, acc = jax.lax.fori_loop(first, jnp.maximum(last, first), body, (m0, l0, a0))
    o_ref[b, kh, sp, :, :] = acc
    m_ref[b, kh, sp, :] = m
    l_ref[b, kh, sp, :] = l


def default_splits(B: int, K: int, max_pages: int, page_size: int, block_kv: int) -> int:
    max_blocks = max(1, (max_pages * page_size) // block_kv)
    want = max(1, 1024 // (B * K))  # ~8 programs per SM on 132 SMs
    return int(max(1, min(want, max_blocks // 2, 32)))


@functools.partial(jax.jit, static_argnames=("window", "block_kv", "num_splits", "num_warps",
                                             "num_stages", "interpret"))
def attention(q_BTNH, k_pages_PSKH, v_pages_PSKH, block_tables_BM, q_pos_BT, sinks_N, window, *,
              block_kv=64, num_splits=None, num_warps=4, num_stages=3, interpret=None):
    """Paged decode attention (T = 1); same function as `attention_reference.attention`."""
    B, T, N, H = q_BTNH.shape
    if T != 1:
        raise ValueError("paged_attention.attention is the decode kernel (T = 1)")
    P, S, K, _ = k_pages_PSKH.shape
    M = block_tables_BM.shape[1]
    G = N // K
    gp = max(16, 1 << (G - 1).bit_length())
    ppb = max(1, block_kv // S)
    bkv = ppb * S
    ns = num_splits or default_splits(B, K, M, S, bkv)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"

    pos = q_pos_BT[:, 0].astype(jnp.int32)
    hi = jnp.where(pos >= 0, pos + 1, 0).astype(jnp.int32)
    lo = jnp.maximum(hi - min(int(window), 2**31 - 1), 0).astype(jnp.int32)
    q = q_BTNH[:, 0].reshape(B, K, G, H)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, gp - G), (0, 0)))
    k_flat = k_pages_PSKH.reshape(P * S, K, H)
    v_flat = v_pages_PSKH.reshape(P * S, K, H)

    o, m, l = pl.pallas_call(
        functools.partial(_kernel, page_size=S, pages_per_block=ppb, num_splits=ns, max_pages=M,
                          scale=H ** -0.5),
        grid=(B, K, ns),
        out_shape=(jax.ShapeDtypeStruct((B, K, ns, gp, H), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, ns, gp), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, ns, gp), jnp.float32)),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="paged_decode_attention",
    )(block_tables_BM.astype(jnp.int32), lo, hi, q, k_flat, v_flat)

    o, m, l = o[:, :, :, :G], m[:, :, :, :G], l[:, :, :, :G]
    sink = sinks_N.astype(jnp.float32).reshape(1, K, 1, G)
    mx = jnp.maximum(jnp.max(m, axis=2, keepdims=True), sink[:, :, :, :])  # [B, K, 1, G]
    w = jnp.exp(m - mx)  # [B, K, ns, G]
    num = jnp.sum(w[..., None] * o, axis=2)  # [B, K, G, H]
    den = jnp.sum(w * l, axis=2) + jnp.exp(sink[:, :, 0] - mx[:, :, 0])  # [B, K, G]
    out = num / den[..., None]
    return out.reshape(B, 1, N, H).astype(q_BTNH.dtype)
