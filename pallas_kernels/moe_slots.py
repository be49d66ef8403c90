"""(token, expert) pairs sorted by expert and cut into slots of at most `block_m` pairs, the unit of work of
every grouped MoE kernel (`moe_gemv`, `moe_mma`, `moe_dense`, `moe_mosaic`), and the way back to tokens.
Every step is a single fusion or XLA's sort (`stable_order` decides; no while loops)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def pick_block(n: int, want: int, least: int = 8) -> int:
    """The largest power-of-two halving of `want` (>= `least`) that divides the feature size `n`."""
    b = want
    while b > least and n % b:
        b //= 2
    if n % b:
        raise ValueError(f"feature size {n} is not a multiple of {least}")
    return b


def stable_order(e_P: jax.Array, num_ids: int, *, counting: bool | None = None, block: int = 256) -> jax.Array:
    """`argsort(e_P, stable=True)` for ids in `[0, num_ids)`. With `counting` (default: on the GPU past 1,024 pairs)
    without a sort: each pair's rank is its id's start, plus the pairs of that id in earlier blocks of `block`, plus
    those earlier in its own block (a few fusions of O(P * (block + num_ids)) compares). On an H200 XLA's sort takes
    33 us at 4,096 pairs (one CTA) and 61-86 us at 32,768, the counting 11-17 us; at 32-512 pairs the sort is as
    fast or up to 3.4 us faster (docs/BENCHMARKS.md §30). On the CPU the sort is the faster."""
    P = e_P.shape[0]
    if counting is None:
        counting = P > 1024 and jax.default_backend() == "gpu"
    if not counting:
        return jnp.argsort(e_P, stable=True).astype(jnp.int32)
    B = min(block, P)
    nb = -(-P // B)
    e = jnp.pad(e_P.astype(jnp.int32), (0, nb * B - P), constant_values=num_ids).reshape(nb, B)  # padding last
    ids = jnp.arange(num_ids + 1, dtype=jnp.int32)
    hits = (e[:, :, None] == ids).astype(jnp.int32)  # [nb, B, ids]
    per_block = jnp.sum(hits, axis=1)  # [nb, ids]
    before = jnp.cumsum(per_block, axis=0) - per_block  # the id's pairs in earlier blocks
    totals = jnp.sum(per_block, axis=0)
    starts = jnp.cumsum(totals) - totals
    i = jnp.arange(B, dtype=jnp.int32)
    inside = jnp.sum((e[:, None, :] == e[:, :, None]) & (i[None, :] < i[:, None])[None], axis=2, dtype=jnp.int32)
    rank = starts[e] + jnp.take_along_axis(before, e, axis=1) + inside  # [nb, B]: a permutation of nb * B
    order = jnp.zeros((nb * B,), jnp.int32).at[rank.reshape(-1)].set(jnp.arange(nb * B, dtype=jnp.int32))
    return order[:P]


def dispatch(idx_TK: jax.Array, w_TK: jax.Array, num_experts: int, block_m: int):
    """Sort (token, expert) pairs by expert and cut them into slots of <= block_m pairs.

    Returns (tok_sorted [P], w_sorted [P] f32, order [P], slot_expert [S], slot_start [S],
    slot_rows [S]) with S = P // block_m + min(E, P) a static bound on the slot count.  Every step
    is a single fusion or sort (`stable_order`; no while loops: `searchsorted` by comparison, not bisection).
    """
    T, k = idx_TK.shape
    P, E = T * k, num_experts
    e_flat = idx_TK.reshape(P).astype(jnp.int32)
    order = stable_order(e_flat, E + 1)  # ids E: pairs routed nowhere (`slots`)
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


def slots(idx_TK, w_TK, valid_TK, E: int, block_m: int):
    """(token, expert) pairs -> `dispatch`'s slots; `block_m` 1 keeps token order (nothing to sort or permute
    back: `order` None). Pairs outside `valid_TK` get no slot."""
    P = idx_TK.size
    if block_m == 1:
        pairs = jnp.arange(P, dtype=jnp.int32)
        rows = jnp.ones((P,), jnp.int32) if valid_TK is None else valid_TK.reshape(P).astype(jnp.int32)
        return (
            pairs // idx_TK.shape[1],
            w_TK.reshape(P).astype(jnp.float32),
            None,
            idx_TK.reshape(P).astype(jnp.int32),
            pairs,
            rows,
        )
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
