"""Attention under a layout: each device runs the single-device attention block on its own shard.

One `jax.shard_map`, manual over the whole mesh: rows (and KV pages) over the attention ranks, and in
low latency the heads over `model` when it divides the KV heads, so each device owns whole GQA groups
(its rows of the q/k/v weights and biases, its columns of the output projection, its sinks and its
heads of the KV pool). Everything else is replicated. Manual because the Pallas kernels (attention and
projections) are custom calls, which GSPMD never partitions: given split operands it would gather
them. The block adds the output projection's partial sums over `model` itself (`heads_axis`).
Projection weights are passed stacked over layers with the layer index, so the projection kernel
reads its layer in place, as on one device.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from pallas_kernels import params as params_lib

STACKED = ("q_w", "k_w", "v_w", "o_w")  # [L, ...] with the layer index
PER_LAYER = ("q_b", "k_b", "v_b", "o_b", "sinks")  # this layer's slice (the scan's)


def heads_axis(layout, num_kv_heads: int) -> str | None:
    """The mesh axis the attention heads are split over (`model`), or None when attention is replicated."""
    return layout.rules(num_kv_heads).get("kv_heads")


def attention(layout, block, num_kv_heads: int, in_kinds: tuple, out_kinds):
    """`block(stacked, per_layer, *args)` run per device. `stacked` and `per_layer` are dicts keyed by `STACKED` /
    `PER_LAYER` `params.Layers` fields, split by the table. `in_kinds` (one per arg) and `out_kinds` are pytrees of
    the args' and the outputs' structure whose leaves say how each array is split: "rows" (leading batch axis, over
    the attention ranks), "pool" (the KV pools), "values" (an FP8 pool's values, `[..., kv_heads, head_dim, slot]`),
    "scales" (an FP8 pool's scales), "heads" (`[B, T, heads]`, heads as the weights split them), or "same"
    (replicated)."""
    axes = params_lib.logical_axes().layers
    spec = lambda logical: layout.spec(logical, num_kv_heads)  # noqa: E731
    stacked = {n: spec(getattr(axes, n)) for n in STACKED}
    per_layer = {n: spec(getattr(axes, n)[1:]) for n in PER_LAYER}
    rows, pool = layout.batch_spec(), layout.cache_sharding(num_kv_heads).spec
    kinds = {
        "rows": rows,
        "pool": pool,
        "values": P(*pool[:2], pool[3], pool[4], pool[2]),  # [layers, pages, kv_heads, head_dim, slot]
        "scales": P(*pool[:2], pool[3], pool[2]),  # [layers, pages, kv_heads, slot]
        "heads": P(rows[0], None, heads_axis(layout, num_kv_heads)),
        "same": P(),
    }
    specs = lambda tree: jax.tree.map(kinds.__getitem__, tree)  # noqa: E731
    return jax.shard_map(
        block,
        mesh=layout.mesh,
        in_specs=(stacked, per_layer, *specs(in_kinds)),
        out_specs=specs(out_kinds),
        check_vma=False,
    )
