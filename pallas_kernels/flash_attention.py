"""Prefill flash attention (T > 1 queries per row) over the paged KV cache: GQA-packed, causal, learned
sinks, and sliding layers that skip every KV block outside the window.

Backend: **Pallas-Triton**, for the reasons in `paged_attention` (page gathers as pointer-tensor
loads, CPU interpret mode in CI).

Design: grid `(batch, kv_heads, query tiles)`.  The `G = N // K` query heads of a KV head are packed
with the chunk's tokens into the rows of one tile (row = token * G + head, `block_q` rows), so each
K/V block is read once for all G heads and the `[block_q, H] x [H, block_kv]` dots fill the tensor
cores even for short chunks.  The rows are read from q and written to the output in their
`[B, T, N, H]` layout (a token's G heads are contiguous), by pointer, rows past T masked: the
transposes and pads this replaced took 8 ms of a 284 ms prefill call (H200, 20b, 2 x 8,192 tokens).
A tile's visible keys are `[min_pos - window + 1, max_pos]` over its valid rows (padded rows have
position -1 and are ignored): the KV loop runs over exactly the `block_kv`-key blocks of that range,
read through the block table (`block_kv / page_size` pages per block), so a sliding layer touches at
most `ceil((window + tokens in tile) / block_kv) + 1` blocks whatever the context, and full layers
stop at the causal diagonal.  The blocks every valid row of the tile sees whole (past the window's
edge, before the diagonal: all but one or two for long prompts) run a loop without any per-key mask;
only the edge blocks mask (causal, window, range), which took the loop from 857 to 362 instructions a
block (docs/kernels.md).  Online softmax in fp32 with the scores in log2 units (one `ex2` a score);
the sink joins the denominator in the epilogue: out = acc / (l + 2^(sink - m)) after rescaling to
max(m, sink).  Rows with no visible key (padding) come out 0.

Over an FP8 pool the K and V tiles convert to f16 with their scales folded in (`k * k_scale`, `v *
v_scale`: one multiply per two values as the tile goes to shared memory for the wgmma), so the scores
and weights need no per-key scaling; the dequantized values are the cached vectors' own magnitudes,
in f16 as the queries already are (up to 65,504).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import kv_quant

NEG = -1e30
LOG2E = 1.4426950408889634  # the scores are kept in log2 units: exp2 is one instruction
BIG = 2**30


def _kernel(
    bt_ref,
    pos_ref,
    sink_ref,
    q_ref,
    k_ref,
    v_ref,
    *refs,
    quantized,
    bq,
    G,
    page_size,
    pages_per_block,
    max_pages,
    window,
    scale,
):
    ks_ref, vs_ref, o_ref = refs if quantized else (None, None, *refs)
    b = pl.program_id(0)
    kh = pl.program_id(1)
    r0 = pl.multiple_of(pl.program_id(2) * bq, bq)
    _, T, _, H = q_ref.shape
    bkv = page_size * pages_per_block
    rows = r0 + jnp.arange(bq)
    tok, head = rows // G, kh * G + rows % G  # row = token * G + head within the KV head's group
    in_T = tok < T
    pos = plt.load(pos_ref.at[b, tok], mask=in_T, other=-1)  # [bq] position of each row's token, -1 = padding
    valid = pos >= 0
    hi = jnp.max(jnp.where(valid, pos, -1)) + 1
    if window >= BIG:
        lo = jnp.int32(0)
    else:
        lo = jnp.maximum(jnp.min(jnp.where(valid, pos, BIG)) - (window - 1), 0)
    blk_lo = lo // bkv
    blk_hi = jnp.maximum((hi + bkv - 1) // bkv, blk_lo)

    hcols = jnp.arange(H)[None, :]
    q_at = (b, tok[:, None], head[:, None], hcols)  # [B, T, N, H] read and written in place: G heads of a token
    q = plt.load(q_ref.at[q_at], mask=in_T[:, None], other=0.0).astype(kv_quant.dot_dtype(quantized, q_ref.dtype))

    def body(blk, carry, masked: bool):
        m, l, acc = carry
        cols = blk * pages_per_block + jnp.arange(pages_per_block)
        pages = plt.load(bt_ref.at[b, cols], mask=cols < max_pages, other=0)
        kpos = blk * bkv + jnp.arange(bkv)
        slots = (pages[:, None] * page_size + jnp.arange(page_size)[None, :]).reshape(bkv)
        in_range = (kpos < hi)[:, None] if masked else None
        k = plt.load(k_ref.at[slots[:, None], kh, hcols], mask=in_range, other=0.0 if masked else None)
        if quantized:  # the FP8 value pool `[P, K, H, S]`: [H, bkv], keys contiguous (`paged_attention._attend`)
            at = kv_quant.value_index(pages, kh, k_ref.shape[1], H, page_size)
            seen = kv_quant.value_mask(blk * pages_per_block, bkv, page_size, 0, hi)[None, :] if masked else None
            v = plt.load(v_ref.at[at], mask=seen, other=0.0 if masked else None)
            at = kv_quant.scale_index(pages, kh, k_ref.shape[1], page_size)
            k_scale, v_scale = (
                plt.load(r.at[at], mask=kpos < hi if masked else None, other=0.0 if masked else None).astype(q.dtype)
                for r in (ks_ref, vs_ref)
            )
            k, v = k.astype(q.dtype) * k_scale[:, None], v.astype(q.dtype) * v_scale[None, :]  # [bkv, H], [H, bkv]
        else:
            v = plt.load(v_ref.at[slots[:, None], kh, hcols], mask=in_range, other=0.0 if masked else None)
        s = jax.lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        s = s * (scale * LOG2E)  # [bq, bkv] in log2 units
        if masked:
            d = pos[:, None] - kpos[None, :]
            s = jnp.where((d >= 0) & (d < window), s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)
        # A row that has seen no key yet keeps m = NEG: subtract 0 instead so that its masked scores give 0, not 1.
        p = jnp.exp2(s - (jnp.where(m_new > NEG, m_new, 0.0) if masked else m_new)[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        if quantized:
            pv = jax.lax.dot_general(p.astype(q.dtype), v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        else:
            pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        acc = acc * alpha[:, None] + pv
        return m_new, l, acc

    # Blocks every valid row sees whole (past the window's edge, before the causal diagonal) skip the masks.
    if window >= BIG:
        full_lo = blk_lo
    else:
        full_lo = jnp.clip((jnp.max(jnp.where(valid, pos, -1)) - window + bkv) // bkv, blk_lo, blk_hi)
    full_hi = jnp.clip((jnp.min(jnp.where(valid, pos, BIG)) + 1) // bkv, full_lo, blk_hi)
    m0 = jnp.full((bq,), NEG, jnp.float32)
    l0 = jnp.zeros((bq,), jnp.float32)
    a0 = jnp.zeros((bq, H), jnp.float32)
    carry = jax.lax.fori_loop(blk_lo, full_lo, functools.partial(body, masked=True), (m0, l0, a0))
    carry = jax.lax.fori_loop(full_lo, full_hi, functools.partial(body, masked=False), carry)
    m, l, acc = jax.lax.fori_loop(full_hi, blk_hi, functools.partial(body, masked=True), carry)
    sink = plt.load(sink_ref.at[head]) * LOG2E
    mf = jnp.maximum(m, sink)
    w = jnp.exp2(m - mf)
    out = acc * (w / (l * w + jnp.exp2(sink - mf)))[:, None]
    out = jnp.where(valid[:, None], out, 0.0)  # padding rows may have run through unmasked blocks
    plt.store(o_ref.at[q_at], out.astype(o_ref.dtype), mask=in_T[:, None])


@functools.partial(jax.jit, static_argnames=("window", "block_q", "block_kv", "num_warps", "num_stages", "interpret"))
def attention(
    q_BTNH,
    k_pages_PSKH,
    v_pages,
    block_tables_BM,
    q_pos_BT,
    sinks_N,
    window,
    *,
    k_scale_PKS=None,
    v_scale_PKS=None,
    block_q=64,
    block_kv=64,
    num_warps=4,
    num_stages=3,
    interpret=None,
):
    """Paged prefill attention (T > 1); same function as `attention_reference.attention` (FP8 pools with their
    scales `[P, K, S]` and values `[P, K, H, S]` too).

    block_q counts (token, head) rows and must be a multiple of G = N // K."""
    B, T, N, H = q_BTNH.shape
    _, S, K, _ = k_pages_PSKH.shape
    M = block_tables_BM.shape[1]
    G = N // K
    bq = block_q
    assert bq % G == 0, (bq, G)
    ppb = max(1, block_kv // S)
    nq = pl.cdiv(T * G, bq)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"

    return pl.pallas_call(
        functools.partial(
            _kernel,
            quantized=k_scale_PKS is not None,
            bq=bq,
            G=G,
            page_size=S,
            pages_per_block=ppb,
            max_pages=M,
            window=min(int(window), BIG),
            scale=H**-0.5,
        ),
        grid=(B, K, nq),
        out_shape=jax.ShapeDtypeStruct((B, T, N, H), q_BTNH.dtype),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_flash_attention",
    )(
        block_tables_BM.astype(jnp.int32),
        q_pos_BT.astype(jnp.int32),
        sinks_N.astype(jnp.float32),
        q_BTNH,
        *kv_quant.flat_pools(k_pages_PSKH, v_pages, k_scale_PKS, v_scale_PKS),
    )
