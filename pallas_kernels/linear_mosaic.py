"""Dense projections on Hopper for 1-256 rows: `x @ w[layer].T + b` for one or several weights sharing x (q, k
and v), stacked `[L, O, I]` over layers and read in place.

Why a second projection kernel: beyond `linear_decode.MAX_ROWS` the model used XLA's GEMM, and inside the layer
scan XLA copies each layer's weights out of the stacked arrays first. In the 20b batch-256 step
(docs/BENCHMARKS.md §4e) the copies took 0.54 ms, the fused q/k/v GEMM 0.79 ms (33 us a layer: 0.9 TB/s) and
the o GEMM 0.30 ms; the bytes are 53 MB a layer (0.37 ms a step at 3.4 TB/s).

Backend: **Mosaic GPU** (`plgpu`): TMA streams the tiles into shared memory and wgmma reads both operands from
there, in a warp-specialized pipeline (one warpgroup issues the copies, two compute). Pallas-Triton reaches
the tensor cores through its own layout conversions, and `linear_decode` measured slower than XLA's GEMM at 256
rows (§4e).

Design: a CTA owns 128 weight rows (64 per compute warpgroup: wgmma M) and all the call's tokens (wgmma N <= 256),
so every weight byte is read once and the token tile is shared by the two warpgroups. K is split over CTAs so
that every SM streams (a 20b q/k/v has 40 row tiles for 132 SMs); the splits meet in the f32 output by TMA
reduce-add, the output starting as the bias. The accumulator is `[weight rows, tokens]`; the epilogue writes it
transposed into shared memory (64 tokens at a time) so the TMA store lands `[T, O]`, the layout XLA's
consumers read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref

from pallas_kernels import layer_index
from pallas_kernels.moe_mosaic import _elements

ROWS = 64  # weight rows per compute warpgroup (wgmma M)
CTA_ROWS = 2 * ROWS
TILE_K = 64  # bf16 K step: one 128-byte swizzled row
MAX_TOKENS = 256  # wgmma N and the TMA box limit
EPI_TOKENS = 64  # tokens per epilogue store
SMEM_BYTES = 200 * 1024


def fits(T: int, I: int, dtype) -> bool:
    """Row counts up to 256, K in whole 64-element steps, 16-bit weights (wgmma's K-major operands). Mosaic GPU runs
    on Hopper only: `pallas_kernels.choice` decides."""
    return (
        0 < T <= MAX_TOKENS
        and I % TILE_K == 0
        and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    )


def padded_tokens(T: int) -> int:
    """The token tile: a multiple of 8 (wgmma N) up to 64, of 64 (the epilogue's stores) beyond."""
    return -(-T // 8) * 8 if T <= EPI_TOKENS else -(-T // EPI_TOKENS) * EPI_TOKENS


def config(T: int, I: int, Os, num_sms: int) -> dict:
    """K splits: the most that keep every CTA in one wave (a divisor of the K steps, so no split reads past K,
    with at least 4 steps each). A second, partial wave costs more than its parallelism gains: q/k/v at 256 rows
    took 29 us in 3 splits (120 CTAs) and 38 us in 5 (200 CTAs) (docs/BENCHMARKS.md §4f). Pipeline stages: as
    many as shared memory holds, up to 8."""
    nk, tiles = I // TILE_K, sum(-(-O // CTA_ROWS) for O in Os)
    divisors = [d for d in range(1, nk + 1) if nk % d == 0 and nk // d >= 4] or [1]
    splits = max([d for d in divisors if tiles * d <= num_sms] or [1])
    stage = (CTA_ROWS + padded_tokens(T)) * TILE_K * 2
    stages = max(2, min(8, (SMEM_BYTES - _epilogue_bytes(T)) // stage))
    return dict(splits=splits, stages=stages)


def _epilogue_tokens(T: int) -> int:
    return min(EPI_TOKENS, padded_tokens(T))


def _epilogue_bytes(T: int) -> int:
    """The f32 staging buffer: one `[tokens, 64]` block per compute warpgroup."""
    return 2 * _epilogue_tokens(T) * ROWS * 4


@plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA, plgpu.RefType()))
def _store_transposed(ctx, acc, wg, out):
    """Accumulator `[64 rows, C tokens]` of warpgroup `wg` (a scalar: it arrives splat) -> `out[wg]` `[C, 64]`."""
    del ctx
    idx = ir.IndexType.get()
    wg = arith.index_cast(idx, wg.registers.flat[0])
    for r, col, v in _elements(acc):
        memref.store(v, out, [wg, col, r])


def linear_many(x_TI, ws_LOI, bs_O, layer, *, splits: int, stages: int, interpret: bool = False):
    """`tuple(x @ w[layer].T + b)` in f32 for each weight (all `[L, O_i, I]`, 16-bit) on one launch. Hopper only:
    there is no interpreted form (`interpret` must be false; the choice takes this kernel on Hopper only)."""
    if interpret:
        raise ValueError("linear_mosaic.linear_many: a Mosaic GPU kernel, Hopper only; it has no interpreted form")
    T, I = x_TI.shape
    Tn, Os = padded_tokens(T), [w.shape[1] for w in ws_LOI]
    C = _epilogue_tokens(T)
    nk = I // TILE_K
    steps = nk // splits
    tiles = [-(-O // CTA_ROWS) for O in Os]
    first = [sum(tiles[:i]) for i in range(len(Os))]
    swizzle = (plgpu.TilingTransform((8, TILE_K)), plgpu.SwizzleTransform(128))
    x = jnp.pad(x_TI.astype(ws_LOI[0].dtype), ((0, Tn - T), (0, 0)))
    y0 = tuple(jnp.broadcast_to(b.astype(jnp.float32), (Tn, O)) for b, O in zip(bs_O, Os))
    mesh = plgpu.Mesh(grid=(sum(tiles), splits), grid_names=("t", "k"), num_threads=3, thread_name="wg")

    def pipeline(mma, context):
        return plgpu.emit_pipeline_warp_specialized(
            mma,
            grid=(steps,),
            memory_registers=40,
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=stages,
            compute_context=context,
            in_specs=[
                plgpu.BlockSpec((CTA_ROWS, TILE_K), lambda k: (0, k), transforms=swizzle),
                plgpu.BlockSpec((Tn, TILE_K), lambda k: (0, k), transforms=swizzle),
            ],
        )

    def body(layer_gmem, x_gmem, *refs):
        w_gmems, y_gmems = refs[: len(Os)], refs[len(Os) :]
        t, s, wg = jax.lax.axis_index("t"), jax.lax.axis_index("k"), jax.lax.axis_index("wg")
        layer = layer_gmem[0]
        kspan = pl.ds(s * steps * TILE_K, steps * TILE_K)
        ignore = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the bodies)
        allocs = pipeline(ignore, ignore).get_allocations(
            w_gmems[0].at[0, pl.ds(0, CTA_ROWS), kspan], x_gmem.at[:, kspan]
        )

        @functools.partial(
            pl.run_scoped, allocs=allocs, out_smem=plgpu.SMEM((2, C, ROWS), jnp.float32), collective_axes="wg"
        )
        def _(allocs, out_smem):
            for i, (w_gmem, y_gmem) in enumerate(zip(w_gmems, y_gmems)):

                @pl.when((t >= first[i]) & (t < first[i] + tiles[i]))
                def _(i=i, w_gmem=w_gmem, y_gmem=y_gmem):
                    row0 = (t - first[i]) * CTA_ROWS

                    def mma(_, w_smem, x_smem, acc_ref):
                        plgpu.wgmma(acc_ref, w_smem.at[pl.ds(wg * ROWS, ROWS)], x_smem.T)
                        plgpu.wgmma_wait(0)
                        return acc_ref

                    def context(run):
                        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((ROWS, Tn), jnp.float32))
                        def _(acc_ref):
                            run(acc_ref)
                            acc = acc_ref[...]
                            mine = row0 + wg * ROWS
                            for c0 in range(0, Tn, C):
                                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                                _store_transposed(acc[:, c0 : c0 + C], wg, out_smem)
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(
                                    out_smem.at[wg],
                                    y_gmem.at[pl.ds(c0, C), pl.ds(mine, ROWS)],
                                    predicate=mine < Os[i],
                                    reduction_op="add",
                                )
                            plgpu.wait_smem_to_gmem(0)

                    pipeline(mma, context)(
                        w_gmem.at[layer, pl.ds(row0, CTA_ROWS), kspan], x_gmem.at[:, kspan], allocations=allocs
                    )

    def stateful(refs):
        layer_ref, x_ref, w_refs, y_refs = refs
        pl.core_map(mesh, compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))(
            lambda: body(layer_ref, x_ref, *w_refs, *y_refs)
        )

    layer_1 = layer_index.value(layer).reshape(1)  # its scalar kernel costs little at the rows this kernel takes
    _, _, _, ys = pl.run_state(stateful)((layer_1, x, tuple(ws_LOI), y0))
    return tuple(y[:T] for y in ys)
