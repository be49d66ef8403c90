"""Grouped GEMM on Hopper (Mosaic GPU) whose weights are groups `first .. first + G` of a larger stack, read in place.

Why a kernel of our own: the prefill MoE's grouped GEMMs (`moe_dense.experts_grouped`) can read every layer's experts
from one bf16 stack made at load (`KernelConfig.moe_prefill_bf16_experts`) instead of dequantizing the layer's
experts every call. Slicing a layer out of that stack inside the layer scan would copy it (20b: 1.6 GB a layer, more
traffic than the dequantization it replaces), and jax's example ragged dot (`ragged_dot_mgpu`) takes its weights as
one whole array. Here the stack and `first` are operands and each tile's TMA reads group `first + g` where it lies.

Work: `lhs` rows come in contiguous groups (`sizes_G`), and each group is cut into tiles of `block_m` rows from its
own first row (rounded down to a multiple of 8: TMA's shared-memory tiles need the window's offset in 8s), about
`sum(cdiv(sizes_G, block_m))` tiles: a group takes the tiles its own rows need. With tiles of fixed `block_m`-row
blocks, every group boundary inside a block made a tile of each group, each reading its group's weights (20b at
1,024 tokens: ~60 tiles a GEMM against ~50; docs/BENCHMARKS.md §32). XLA numbers the tiles beforehand
(`tile_starts`: a group's first tile and first row), so a tile finds its group with G scalar compares. A persistent
grid of one CTA per SM walks (tile, N block) pairs in bands of `band` N blocks (neighbouring CTAs share lhs rows in
L2). A tile runs a TMA -> wgmma pipeline over K with `stages` steps in flight into an f32 accumulator, then stores
only its group's rows of the window: TMA boxes are static, so the rows go out as a sum of power-of-two boxes, one
per set bit of the row count. Rows outside every group are left unwritten.

`ragged_dot_reference` is the same function in `lax.ragged_dot`, and stands in off the GPU: Pallas's Mosaic GPU
interpreter cannot run the TMA pipeline (its copies have no state-discharge rule), so CI checks the tile arithmetic
on plain arrays and the lowering for an H200 (tests/test_ragged_dot.py, tests/test_kernels_moe.py), and
tools/check_kernels.py runs the kernel on the GPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

SMS = 132  # CTAs of the persistent grid: H100 SXM's and H200's SM count (fewer SMs: the CTAs run in two waves)


def ragged_dot_reference(lhs_MK, w_all, first, sizes_G):
    """`lhs` rows in contiguous groups of `sizes_G` rows times `w_all[first + g].T`: `[M, N]` in lhs's dtype
    (accumulated in f32). Rows past the groups are 0."""
    w = jax.lax.dynamic_slice_in_dim(w_all, first, sizes_G.shape[0])
    out = jax.lax.ragged_dot(lhs_MK, jnp.swapaxes(w, 1, 2), sizes_G, preferred_element_type=jnp.float32)
    return out.astype(lhs_MK.dtype)


def tile_starts(sizes_G, block_m: int):
    """`[2, G]` int32: each group's first tile (tiles numbered group by group; a group's tiles cut its rows into
    `block_m`-row windows from its first row rounded down to a multiple of 8, `_locate`'s; an empty group has none
    and shares its successor's number) and its first row."""
    sizes = sizes_G.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    tiles = jnp.where(sizes > 0, (starts % 8 + sizes + block_m - 1) // block_m, 0)
    return jnp.stack([jnp.cumsum(tiles) - tiles, starts]).astype(jnp.int32)


def ragged_dot(
    lhs_MK,
    w_all,
    first,
    sizes_G,
    *,
    block_m: int = 128,
    block_n: int = 128,
    block_k: int = 64,
    stages: int = 4,
    band: int = 1,
):
    """`ragged_dot_reference` as one Mosaic GPU kernel. `w_all` `[groups, N, K]` (K-major rows, as `x @ w.T`);
    `first` a traced scalar; `sizes_G` sums to at most M. N must divide by `block_n` into a multiple of `band`
    blocks, K by `block_k`, and M by 8 (windows start at multiples of 8)."""
    M, K = lhs_MK.shape
    _, N, K2 = w_all.shape
    G = sizes_G.shape[0]
    if K != K2 or K % block_k or N % block_n or (N // block_n) % band or M % 8 or lhs_MK.dtype != w_all.dtype:
        raise ValueError(
            f"ragged_dot: lhs {lhs_MK.shape} {lhs_MK.dtype} and weights {w_all.shape} {w_all.dtype} do not tile "
            f"by block_n={block_n}, block_k={block_k}, band={band}"
        )
    grid_m, grid_n = pl.cdiv(M + 7 * G, block_m) + G - 1, N // block_n  # bounds `tile_starts`' count
    table = tile_starts(sizes_G, block_m)
    first_G = (jnp.asarray(first, jnp.int32) + jnp.arange(G, dtype=jnp.int32))[None]
    operands = jnp.concatenate([table, first_G, sizes_G.astype(jnp.int32)[None]]).reshape(4 * G)  # 4 rows of G

    body = functools.partial(
        _body, G=G, M=M, K=K, grid=(grid_m, grid_n), band=band, bm=block_m, bn=block_n, bk=block_k, stages=stages
    )
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((M, N), lhs_MK.dtype),
        grid=(SMS,),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return kernel(operands, lhs_MK, w_all)


def _locate(table_ref, G: int, tile, bm: int, M: int):
    """Tile `tile`'s weight group (absolute), the first row of its `bm`-row lhs window in 8s (TMA's smem tiling
    needs the offset provably a multiple of 8; within `[0, M - bm]` where M allows), the group's first row within
    the window, and the group's rows in it (0: no work)."""
    group = jnp.int32(0)
    for g in range(1, G):  # the last group whose first tile is <= tile (empty groups yield to their successor)
        group = jnp.where(table_ref[g] <= tile, jnp.int32(g), group)
    first_tile = start = w_index = size = jnp.int32(0)
    for g in range(G):
        mine = group == g
        first_tile = jnp.where(mine, table_ref[0 * G + g], first_tile)
        start = jnp.where(mine, table_ref[1 * G + g], start)
        w_index = jnp.where(mine, table_ref[2 * G + g], w_index)
        size = jnp.where(mine, table_ref[3 * G + g], size)
    lo = start // 8 * 8 + (tile - first_tile) * bm  # this tile's rows: [lo, lo + bm) within the group's
    window8 = jnp.maximum(jnp.minimum(lo // 8, (M - bm) // 8), 0)
    first, end = jnp.maximum(start, lo), jnp.minimum(start + size, lo + bm)
    return w_index, window8, first - window8 * 8, jnp.maximum(end - first, 0)


def _body(table_ref, lhs_ref, w_ref, out_ref, *, G, M, K, grid, band, bm, bn, bk, stages):
    @plgpu.nd_loop((grid[0] * grid[1],), collective_axes="sm")
    def _tile(loop):
        mi, ni = plgpu.planar_snake(loop.index[0], grid, 1, band)
        w_index, window8, row0, rows = _locate(table_ref, G, mi, bm, M)

        @pl.when(rows > 0)
        def _():
            def accumulate(acc_ref):
                plgpu.emit_pipeline(
                    lambda _, x_smem, w_smem: plgpu.wgmma(acc_ref, x_smem, w_smem.T),
                    grid=(K // bk,),
                    in_specs=[
                        plgpu.BlockSpec((pl.Element(bm), bk), lambda k: (window8 * 8, k), delay_release=1),
                        plgpu.BlockSpec((bn, bk), lambda k: (ni, k), delay_release=1),
                    ],
                    max_concurrent_steps=stages,
                )(lhs_ref, w_ref.at[w_index])
                return acc_ref[...]

            acc = pl.run_scoped(accumulate, plgpu.ACC((bm, bn)))

            def store(o_smem):
                o_smem[...] = acc.astype(o_smem.dtype)
                plgpu.commit_smem()
                done = row0
                for p in reversed(range(int(math.log2(min(bm, M))) + 1)):  # one box per set bit of `rows`
                    box = 1 << p

                    @pl.when((rows & box) != 0)
                    def _():
                        plgpu.copy_smem_to_gmem(
                            o_smem.at[pl.ds(done, box)], out_ref.at[pl.ds(window8 * 8 + done, box), pl.ds(ni * bn, bn)]
                        )

                    done = done + (rows & box)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            pl.run_scoped(store, plgpu.SMEM((bm, bn), out_ref.dtype))
