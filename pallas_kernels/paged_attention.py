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
online softmax in fp32 and writes (acc, max, sum); the splits are merged with the sink added to the
denominator, out = sum_s e^(m_s - M) acc_s / (sum_s e^(m_s - M) l_s + e^(sink - M)), by a tiny JAX
epilogue (`attention`) or, in `attention_new_token` (the serving decode), by the last split to finish.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import attention_reference, kv_quant, layer_index, rope

NEG = -1e30


def _attend(
    q,
    m,
    l,
    acc,
    lo,
    hi,
    b,
    kh,
    sp,
    bt_ref,
    k_ref,
    v_ref,
    scale_refs,
    *,
    page_size,
    pages_per_block,
    num_splits,
    max_pages,
    scale,
    page_offset=0,
):
    """Online softmax of the `[gp, H]` queries of KV head `kh` over split `sp`'s share of the key blocks
    covering positions `[lo, hi)` of row `b`, continuing from `(m, l, acc)`. Pages are the table's entries
    plus `page_offset` (a layer's first page in a pool of all layers). `scale_refs`: the FP8 pools' per-(slot,
    head) scales `(k, v)` (`kv_quant`), flat `[P * K * S]`, or None; with them `v_ref` is the FP8 value pool
    `[P, K, H, S]` flat (`kv_quant.value_index`)."""
    bkv = page_size * pages_per_block
    blk_lo = lo // bkv
    blk_hi = (hi + bkv - 1) // bkv
    nblk = jnp.maximum(blk_hi - blk_lo, 0)
    per = (nblk + num_splits - 1) // num_splits
    first = blk_lo + sp * per
    last = jnp.minimum(first + per, blk_hi)
    hcols = jnp.arange(q.shape[1])[None, :]
    q = q.astype(kv_quant.dot_dtype(scale_refs is not None, q.dtype))

    def body(blk, carry):
        m, l, acc = carry
        cols = blk * pages_per_block + jnp.arange(pages_per_block)
        pages = (
            plt.load(bt_ref.at[b, pl.ds(blk * pages_per_block, pages_per_block)], mask=cols < max_pages, other=0)
            + page_offset
        )
        pos = blk * bkv + jnp.arange(bkv)
        ok = (pos >= lo) & (pos < hi)
        rows = (pages[:, None] * page_size + jnp.arange(page_size)[None, :]).reshape(bkv)
        # (a float `other`: Triton casts no integer to fp8)
        k = plt.load(k_ref.at[rows[:, None], kh, hcols], mask=ok[:, None], other=0.0).astype(q.dtype)
        if scale_refs is None:
            v = plt.load(v_ref.at[rows[:, None], kh, hcols], mask=ok[:, None], other=0.0).astype(q.dtype)  # [bkv, H]
        else:  # [H, bkv], keys contiguous: 16-byte loads, and a dot operand read as K's, not byte by byte
            at = kv_quant.value_index(pages, kh, k_ref.shape[1], q.shape[1], page_size)
            seen = kv_quant.value_mask(blk * pages_per_block, bkv, page_size, lo, hi)
            v = plt.load(v_ref.at[at], mask=seen[None, :], other=0.0).astype(q.dtype)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale  # [gp, bkv]
        if scale_refs is not None:
            at = kv_quant.scale_index(pages, kh, k_ref.shape[1], page_size)
            k_scale, v_scale = (plt.load(r.at[at], mask=ok, other=0.0) for r in scale_refs)
            s = s * k_scale[None, :]
        s = jnp.where(ok[None, :], s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        p = jnp.where(ok[None, :], p, 0.0)
        l = l * alpha + jnp.sum(p, axis=1)
        w, top = (p.astype(v.dtype), 1.0) if scale_refs is None else kv_quant.value_weights(p, v_scale, v.dtype)
        pv_dims = (((1,), (0 if scale_refs is None else 1,)), ((), ()))  # w @ v, or w @ v.T for [H, bkv]
        acc = acc * alpha[:, None] + jax.lax.dot_general(w, v, pv_dims, preferred_element_type=jnp.float32) * top
        return m_new, l, acc

    return jax.lax.fori_loop(first, jnp.maximum(last, first), body, (m, l, acc))


def _kernel(bt_ref, lo_ref, hi_ref, q_ref, k_ref, v_ref, *refs, quantized, **config):
    scale_refs, (o_ref, m_ref, l_ref) = (refs[:2], refs[2:]) if quantized else (None, refs)
    b, kh, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    gp, H = q_ref.shape[2], q_ref.shape[3]
    m, l, acc = _attend(
        q_ref[b, kh, :, :],
        jnp.full((gp,), NEG, jnp.float32),
        jnp.zeros((gp,), jnp.float32),
        jnp.zeros((gp, H), jnp.float32),
        lo_ref[b],
        hi_ref[b],
        b,
        kh,
        sp,
        bt_ref,
        k_ref,
        v_ref,
        scale_refs,
        **config,
    )
    o_ref[b, kh, sp, :, :] = acc
    m_ref[b, kh, sp, :] = m
    l_ref[b, kh, sp, :] = l


def default_splits(
    B: int,
    K: int,
    max_pages: int,
    page_size: int,
    block_kv: int,
    split_programs: int,
    max_splits: int,
    blocks_per_split: int = 2,
) -> int:
    """Sequence splits per (row, KV head): about `split_programs` programs in all, at most `max_splits`, and at
    least `blocks_per_split` key blocks per split."""
    max_blocks = max(1, (max_pages * page_size) // block_kv)
    want = max(1, split_programs // (B * K))
    return int(max(1, min(want, max_blocks // blocks_per_split, max_splits)))


def _new_token_kernel(
    bt_ref,
    pos_ref,
    wpage_ref,
    wslot_ref,
    layer_ref,
    map_ref,
    qp_ref,
    kp_ref,
    vp_ref,
    qb_ref,
    kb_ref,
    vb_ref,
    sinks_ref,
    cos_ref,
    sin_ref,
    k_ref,
    v_ref,
    *refs,
    quantized,
    window,
    null_page,
    G,
    T,
    interpret,
    **config,
):
    """`_kernel` for a new token, from its q/k/v projections' split-K partial sums: sums them with the bias (the
    layer's row of the stacked biases, `layer_index.read`), rotates q and k (RoPE), writes k and v into the cache
    (split 0), and attends to the cached keys plus the new one, which split 0 takes from registers (its slot is being
    written, so no split reads it); the last split of the (token, KV head) to finish merges them all (`_merge_splits`).
    A token whose write goes to the null page (padding, a prefix-cached position) reads its key from the cache.
    Tokens come `T` to a table row (a speculative verify step's k + 1): token t of a row also attends to the row's
    earlier new tokens, which split 0 computes from their partial sums too, since the programs writing them may not
    have run. A row's new tokens sit at consecutive positions, cached (null-page) ones before fresh ones and padding
    last, so every split reads the cache only below the row's first fresh position.
    With `quantized` (FP8 pools), `refs` starts with the pools' scales and their outputs follow `v_out`, and the
    value pool is `[P, K, H, S]` flat; the new tokens' k and v are stored as `kv_quant.quantize` does, and split 0
    attends to the stored (rounded) values."""
    if quantized:
        ks_ref, vs_ref, _, o_ref, m_ref, l_ref, out_ref, k_out, v_out, ks_out, vs_out, done_ref = refs
        scale_refs = (ks_ref, vs_ref)
    else:
        _, o_ref, m_ref, l_ref, out_ref, k_out, v_out, done_ref = refs
        scale_refs = None
    r, kh, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    b, t = r // T, r % T  # the table row, the token's place in it
    gp, H = o_ref.shape[3], o_ref.shape[4]
    dtype, half, S = cos_ref.dtype, H // 2, config["page_size"]
    p, page = pos_ref[r], wpage_ref[r]
    page_offset, layer = layer_index.read_page_offset(layer_ref, map_ref), layer_index.read(layer_ref, map_ref)
    fresh = (page != null_page) & (p >= 0)
    here = fresh & (sp == 0)
    hi = jnp.where(p >= 0, p + 1, 0)
    lo = jnp.maximum(hi - window, 0)
    h = jnp.arange(H)
    first_half = h < half
    partner = jnp.where(first_half, h + half, h - half)

    def project(parts_ref, bias_ref, row, cols, mask):  # the consumer half of `linear_decode.linear_many`
        y = plt.load(parts_ref.at[0, row, cols], mask=mask, other=0)
        for i in range(1, parts_ref.shape[0]):
            y = y + plt.load(parts_ref.at[i, row, cols], mask=mask, other=0)
        return (y + plt.load(bias_ref.at[layer, cols], mask=mask, other=0).astype(jnp.float32)).astype(dtype)

    def rotated(parts_ref, bias_ref, row, cols, mask):  # `rope.apply`: first half pairs with second half
        c, sn = (plt.load(ref.at[row, h % half]) for ref in (cos_ref, sin_ref))
        x, x_partner = (project(parts_ref, bias_ref, row, cc, mask) for cc in (cols(h), cols(partner)))
        return jnp.where(first_half, x * c - x_partner * sn, x * c + x_partner * sn)

    def key_value(row):  # a new token's k and v as split 0 attends to them, and as stored (FP8: with the scales)
        all_h = jnp.full((H,), True)
        k = rotated(kp_ref, kb_ref, row, lambda cols: kh * H + cols, all_h)
        v = project(vp_ref, vb_ref, row, kh * H + h, all_h)
        if not quantized:
            return k, v, (k, v)
        k_scale, v_scale = (kv_quant.scale_of(jnp.max(jnp.abs(x.astype(jnp.float32)))) for x in (k, v))
        k_store, v_store = ((x.astype(jnp.float32) / sc).astype(k_ref.dtype) for x, sc in ((k, k_scale), (v, v_scale)))
        return (
            k_store.astype(jnp.float32) * k_scale,
            v_store.astype(jnp.float32) * v_scale,
            (k_store, v_store, k_scale, v_scale),
        )

    g = jnp.arange(gp)[:, None]
    g_ok = jnp.broadcast_to(g < G, (gp, H))
    q = rotated(qp_ref, qb_ref, r, lambda cols: (kh * G + g) * H + cols[None, :], g_ok)
    k_new, v_new, stored = key_value(r)

    @pl.when(here)
    def _():
        row = (page_offset + page) * S + wslot_ref[r]
        k_out[row, kh, :] = stored[0]
        if not quantized:
            v_out[row, kh, :] = stored[1]
        else:
            head = (page_offset + page) * k_ref.shape[1] + kh  # the (page, KV head) written
            v_out[(head * H + h) * S + wslot_ref[r]] = stored[1]  # the slot's column of its [H, S]
            ks_out[head * S + wslot_ref[r]] = stored[2]
            vs_out[head * S + wslot_ref[r]] = stored[3]

    # Split 0 starts the online softmax from the new keys, one at a time (one key's k and v live at once): this
    # token's and its row's earlier fresh ones.
    def admit(carry, on, k, v):
        m, l, acc = carry
        s_k = jnp.sum(q.astype(jnp.float32) * k.astype(jnp.float32)[None, :], axis=1) * config["scale"]
        m_new = jnp.where(on, jnp.maximum(m, s_k), m)
        w, alpha = jnp.where(on, jnp.exp(s_k - m_new), 0.0), jnp.exp(m - m_new)
        return m_new, l * alpha + w, acc * alpha[:, None] + w[:, None] * v.astype(jnp.float32)[None, :]

    carry = (jnp.full((gp,), NEG, jnp.float32), jnp.zeros((gp,), jnp.float32), jnp.zeros((gp, H), jnp.float32))
    carry = admit(carry, here, k_new, v_new)
    n_new = fresh.astype(jnp.int32)  # the new keys the cache is not read for
    for i in range(T - 1):  # token i < t of the row
        ri = b * T + i
        p_i = pos_ref[ri]
        fresh_i = (i < t) & (wpage_ref[ri] != null_page) & (p_i >= 0) & (p >= 0)  # (padding attends to nothing)
        carry = admit(carry, fresh_i & (sp == 0) & (p_i >= lo), *key_value(ri)[:2])
        n_new += fresh_i.astype(jnp.int32)
    m, l, acc = carry
    m, l, acc = _attend(
        q,
        m,
        l,
        acc,
        lo,
        hi - n_new,
        b,
        kh,
        sp,
        bt_ref,
        k_ref,
        v_ref,
        scale_refs,
        page_offset=page_offset,
        **config,
    )
    o_ref[r, kh, sp, :, :] = acc
    m_ref[r, kh, sp, :] = m
    l_ref[r, kh, sp, :] = l
    _merge_splits(o_ref, m_ref, l_ref, sinks_ref, layer, out_ref, done_ref, r, kh, G, config["num_splits"], interpret)


def _merge_splits(o_ref, m_ref, l_ref, sinks_ref, layer, out_ref, done_ref, b, kh, G: int, ns: int, interpret: bool):
    """Called by every split of (row `b`, KV head `kh`) once its partials are stored: the last one to arrive
    (counted in `done_ref[b, kh]`, which it resets to 0 for the next launch) reads all of them back and writes
    `_combine`'s output for the head's G query heads, with row `layer` of the stacked sinks. In the decode step
    this replaces two XLA kernels a layer on the critical path (20b batch 1: 4% of the step,
    docs/BENCHMARKS.md §7e). The count is an acquire-release atomic at GPU scope after a block barrier, so every
    thread's partials of every split are visible to the last one (and no L1 line of them is stale: no program
    reads a partial before the count says all are stored). The partials' split axis is padded to a power of
    two, so that whole tiles of it load in bounds."""
    if not interpret:  # (the interpreter runs programs one after another; it has no barrier)
        plt.debug_barrier()
    arrived = plt.atomic_add(done_ref, (b, kh), jnp.int32(1))

    @pl.when(arrived == ns - 1)
    def _():
        done_ref[b, kh] = jnp.int32(0)
        gq, nsp, H = 1 << (G - 1).bit_length(), 1 << (ns - 1).bit_length(), o_ref.shape[-1]
        g_ok = jnp.arange(gq) < G
        ok = (jnp.arange(nsp) < ns)[:, None] & g_ok[None, :]
        m = plt.load(m_ref.at[b, kh, pl.ds(0, nsp), pl.ds(0, gq)], mask=ok, other=NEG)
        l = plt.load(l_ref.at[b, kh, pl.ds(0, nsp), pl.ds(0, gq)], mask=ok, other=0.0)
        sink = plt.load(sinks_ref.at[layer, pl.ds(kh * G, gq)], mask=g_ok, other=0.0).astype(jnp.float32)
        mx = jnp.maximum(jnp.max(m, axis=0), sink)  # [gq]
        den = jnp.sum(jnp.exp(m - mx[None, :]) * l, axis=0) + jnp.exp(sink - mx)
        num = jnp.zeros((gq, H), jnp.float32)
        chunk = min(nsp, 8)  # splits per load: [chunk, gq, H] f32 stays within registers
        for c0 in range(0, ns, chunk):
            c_ok = ((c0 + jnp.arange(chunk)) < ns)[:, None] & g_ok[None, :]
            mc = plt.load(m_ref.at[b, kh, pl.ds(c0, chunk), pl.ds(0, gq)], mask=c_ok, other=NEG)
            oc = plt.load(o_ref.at[b, kh, pl.ds(c0, chunk), pl.ds(0, gq), :], mask=c_ok[:, :, None], other=0.0)
            num = num + jnp.sum(jnp.exp(mc - mx[None, :])[:, :, None] * oc, axis=0)
        plt.store(out_ref.at[b, pl.ds(kh * G, gq), :], (num / den[:, None]).astype(out_ref.dtype), mask=g_ok[:, None])


def new_token_reference(
    qkv_parts,
    qkv_bias_LO,
    layer,
    cos_BF,
    sin_BF,
    k_pages_PSKH,
    v_pages,
    block_tables_BM,
    page_offset,
    q_pos_B,
    write_page_B,
    write_slot_B,
    sinks_LN,
    window,
    *,
    k_scale_PKS=None,
    v_scale_PKS=None,
    tokens_per_row=1,
):
    """`attention_new_token` as the model computes it without the kernel: sums, bias, cast, `rope.apply`, both
    pools written at (page + offset, slot) (null-page writes included; FP8 pools with `kv_quant.quantize`, values
    `[P, K, H, S]`), `attention_reference` through the offset table, the tokens of a row as one query chunk. Returns
    (out `[R, 1, N, H]`, k pages, v pages, k scales, v scales)."""
    R, H, dtype = q_pos_B.shape[0], k_pages_PSKH.shape[-1], cos_BF.dtype
    B, T = R // tokens_per_row, tokens_per_row
    if page_offset is None:
        page_offset = layer_index.of(layer).page_offset()
    layer = layer_index.value(layer)
    q, k, v = (
        (jnp.sum(y, 0) + b[layer].astype(jnp.float32)).astype(dtype).reshape(R, 1, -1, H)
        for y, b in zip(qkv_parts, qkv_bias_LO)
    )
    q, k = (rope.apply(a, cos_BF[:, None], sin_BF[:, None]) for a in (q, k))
    at = (write_page_B + page_offset, write_slot_B)
    pools, scales = [k_pages_PSKH, v_pages], [k_scale_PKS, v_scale_PKS]
    for i, x in enumerate((k[:, 0], v[:, 0])):
        if scales[i] is None:
            pools[i] = pools[i].at[at].set(x)
            continue
        x, sc = kv_quant.quantize(x)
        scales[i] = kv_quant.set_scales(scales[i], at, sc)
        pools[i] = kv_quant.set_values(pools[i], at, x) if i else pools[i].at[at].set(x)
    out = attention_reference.attention(
        q.reshape(B, T, *q.shape[2:]),
        *pools,
        block_tables_BM + page_offset,
        q_pos_B.reshape(B, T),
        sinks_LN[layer],
        window,
        k_scale_PKS=scales[0],
        v_scale_PKS=scales[1],
    )
    return out.reshape(R, 1, *out.shape[2:]), *pools, *scales


def _geometry(B, N, S, K, M, block_kv, num_splits, split_programs, max_splits, span=None):
    """(G, gp, pages per block, splits) of a launch. `span`: the most keys a query can see (a sliding layer's window
    plus a row's other new tokens): such a launch takes a split for each block that window can cover, not splits
    over the table's blocks, most of which would get no keys and still sum the projections' partials and merge."""
    G = N // K
    gp = max(16, 1 << (G - 1).bit_length())
    ppb = max(1, block_kv // S)
    per_split = 2
    if span is not None:  # `span` keys, unaligned, cover at most ceil(span / block) + 1 blocks: one split each
        M, per_split = (-(-span // (ppb * S)) + 1) * ppb, 1
    return G, gp, ppb, num_splits or default_splits(B, K, M, S, ppb * S, split_programs, max_splits, per_split)


def _combine(o, m, l, sinks_N, G, dtype):
    """Merge the splits' `(acc, max, sum)` `[B, K, splits, gp, ...]` and add the sink to the denominator:
    out = sum_s e^(m_s - M) acc_s / (sum_s e^(m_s - M) l_s + e^(sink - M)) -> `[B, 1, N, H]`."""
    B, K, _, _, H = o.shape
    o, m, l = o[:, :, :, :G], m[:, :, :, :G], l[:, :, :, :G]
    sink = sinks_N.astype(jnp.float32).reshape(1, K, 1, G)
    mx = jnp.maximum(jnp.max(m, axis=2, keepdims=True), sink)  # [B, K, 1, G]
    w = jnp.exp(m - mx)  # [B, K, ns, G]
    num = jnp.sum(w[..., None] * o, axis=2)  # [B, K, G, H]
    den = jnp.sum(w * l, axis=2) + jnp.exp(sink[:, :, 0] - mx[:, :, 0])  # [B, K, G]
    return (num / den[..., None]).reshape(B, 1, K * G, H).astype(dtype)


def _partials_shapes(B, K, ns, gp, H):
    return (
        jax.ShapeDtypeStruct((B, K, ns, gp, H), jnp.float32),
        jax.ShapeDtypeStruct((B, K, ns, gp), jnp.float32),
        jax.ShapeDtypeStruct((B, K, ns, gp), jnp.float32),
    )


_LAUNCH = ("block_kv", "num_splits", "split_programs", "max_splits", "num_warps", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=("window", "null_page", "tokens_per_row") + _LAUNCH)
def attention_new_token(
    qkv_parts,
    qkv_bias_LO,
    layer,
    cos_BF,
    sin_BF,
    k_pages_PSKH,
    v_pages,
    block_tables_BM,
    page_offset,
    q_pos_B,
    write_page_B,
    write_slot_B,
    sinks_LN,
    window,
    done_BK=None,
    *,
    k_scale_PKS=None,
    v_scale_PKS=None,
    null_page=0,
    tokens_per_row=1,
    block_kv=64,
    num_splits=None,
    split_programs=512,
    max_splits=32,
    num_warps=4,
    num_stages=3,
    interpret=None,
):
    """New tokens, `tokens_per_row` to a row of `block_tables_BM` (R = B * tokens_per_row in all), from the split-K
    partial sums of their q, k and v projections (`linear_decode.partial_sums`, each `[splits, R, heads * H]`), their
    biases and the sinks (layer `layer` of `qkv_bias_LO` and `sinks_LN`, stacked over layers: no per-layer slice) to
    their attention output `[R, 1, N, H]`, writing their rotated k and v into the pools: the projections' epilogue
    (sum, bias, cast, RoPE with `cos_BF`/`sin_BF` `[R, H/2]`), the cache write, the attention and the merge of its
    sequence splits in one launch, where XLA spends a dozen small kernels a layer on them. The pools (`[P, S, K, H]`,
    updated in place when donated) may hold several layers: the table's pages are offset by `page_offset` (None:
    `layer`'s, a `layer_index.LayerIndex` of the layer scan), as is `write_page_B` (`null_page` = no write);
    `write_slot_B` is the slot in the page. Several tokens of a row (a speculative verify step's) sit at consecutive
    positions, null-page ones before the others and padding last; each attends causally (`_new_token_kernel`).
    `done_BK` (int32 `[R, K]`, all 0; updated in place when donated) counts finished splits, and every launch
    leaves it at 0: a decode step threads one through all its layers, where a fresh one each layer would cost a
    memset kernel on the critical path. None: a fresh one. FP8 pools come with their scales `[P, K, S]`
    (`kv_quant`), written beside them, and keep their values `[P, K, H, S]`. Returns (out, k pages, v pages,
    done_BK, k scales, v scales), the scales None without. `num_splits` None: `default_splits`. The launch
    settings' defaults are `KernelConfig`'s (`attention_*`; FP8 pools: `attention_fp8_*`).

    The same function as `new_token_reference`, except that null-page writes are skipped."""
    q_parts, k_parts, v_parts = qkv_parts
    R = q_parts.shape[1]
    _, S, K, H = k_pages_PSKH.shape
    N = q_parts.shape[2] // H
    M = block_tables_BM.shape[1]
    if R != block_tables_BM.shape[0] * tokens_per_row:
        raise ValueError(f"{R} tokens for {block_tables_BM.shape[0]} table rows of {tokens_per_row} tokens")
    span = int(window) + tokens_per_row if window < 2**31 - 1 else None
    G, gp, ppb, ns = _geometry(R, N, S, K, M, block_kv, num_splits, split_programs, max_splits, span)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    flat = kv_quant.flat_pools(k_pages_PSKH, v_pages, k_scale_PKS, v_scale_PKS)
    dtype = cos_BF.dtype
    if done_BK is None:
        done_BK = jnp.zeros((R, K), jnp.int32)
    outs = pl.pallas_call(
        functools.partial(
            _new_token_kernel,
            quantized=k_scale_PKS is not None,
            window=min(int(window), 2**31 - 1),
            null_page=null_page,
            G=G,
            T=tokens_per_row,
            interpret=interpret,
            page_size=S,
            pages_per_block=ppb,
            num_splits=ns,
            max_pages=M,
            scale=H**-0.5,
        ),
        grid=(R, K, ns),
        out_shape=(
            *_partials_shapes(R, K, 1 << (ns - 1).bit_length(), gp, H),
            jax.ShapeDtypeStruct((R, N, H), dtype),
            *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in flat),
            jax.ShapeDtypeStruct((R, K), jnp.int32),
        ),
        input_output_aliases={15 + i: 4 + i for i in range(len(flat) + 1)},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_decode_attention_new_token",
    )(
        i32(block_tables_BM),
        i32(q_pos_B),
        i32(write_page_B),
        i32(write_slot_B),
        *layer_index.operands(layer, page_offset),
        q_parts,
        k_parts,
        v_parts,
        *qkv_bias_LO,
        sinks_LN,
        cos_BF,
        sin_BF,
        *flat,
        done_BK,
    )
    out, written, done_BK = outs[3], outs[4:-1], outs[-1]
    k_pages, v_pages = (a.reshape(p.shape) for a, p in zip(written[:2], (k_pages_PSKH, v_pages)))
    k_scale, v_scale = (a.reshape(k_scale_PKS.shape) for a in written[2:]) if k_scale_PKS is not None else (None, None)
    return out.reshape(R, 1, N, H), k_pages, v_pages, done_BK, k_scale, v_scale


@functools.partial(jax.jit, static_argnames=("window",) + _LAUNCH)
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
    block_kv=64,
    num_splits=None,
    split_programs=512,
    max_splits=32,
    num_warps=4,
    num_stages=3,
    interpret=None,
):
    """Paged decode attention (T = 1); same function as `attention_reference.attention` (FP8 pools with their
    scales `[P, K, S]` and values `[P, K, H, S]` too)."""
    B, T, N, H = q_BTNH.shape
    if T != 1:
        raise ValueError("paged_attention.attention is the decode kernel (T = 1)")
    _, S, K, _ = k_pages_PSKH.shape
    M = block_tables_BM.shape[1]
    span = int(window) if window < 2**31 - 1 else None
    G, gp, ppb, ns = _geometry(B, N, S, K, M, block_kv, num_splits, split_programs, max_splits, span)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"

    pos = q_pos_BT[:, 0].astype(jnp.int32)
    hi = jnp.where(pos >= 0, pos + 1, 0).astype(jnp.int32)
    lo = jnp.maximum(hi - min(int(window), 2**31 - 1), 0).astype(jnp.int32)
    q = q_BTNH[:, 0].reshape(B, K, G, H)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, gp - G), (0, 0)))
    pools = kv_quant.flat_pools(k_pages_PSKH, v_pages, k_scale_PKS, v_scale_PKS)

    o, m, l = pl.pallas_call(
        functools.partial(
            _kernel,
            quantized=k_scale_PKS is not None,
            page_size=S,
            pages_per_block=ppb,
            num_splits=ns,
            max_pages=M,
            scale=H**-0.5,
        ),
        grid=(B, K, ns),
        out_shape=_partials_shapes(B, K, ns, gp, H),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_decode_attention",
    )(block_tables_BM.astype(jnp.int32), lo, hi, q, *pools)
    return _combine(o, m, l, sinks_N, G, q_BTNH.dtype)
