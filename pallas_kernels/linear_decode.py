"""Dense projections for decode (up to 64 rows): `x @ w[layer].T + b`, reading layer `layer` of
stacked `[L, O, I]` weights in place, for one weight (`linear`) or several sharing x (`linear_many`).

Why a kernel: the attention projections are 2/3 of the non-expert bytes a decode step reads, and
XLA handles them badly inside the layer scan: the scan slices each layer's weights out of the
stacked arrays into a fresh buffer (a full copy, ~53 MB per 20b layer; 0.84 ms of a 4.5 ms batch-1
step, measured) before cuBLAS reads them again at ~40% of the copy bandwidth. Here the layer index
is an offset into the stacked array, and the weight is streamed once.

Why several weights per launch: at batch 1 the small projections cost launch latency, not bytes. In
the 20b batch-1 profile (docs/BENCHMARKS.md §7) the k and v projections ([512 x 2880], 2.9 MB each)
take 3.6 us apiece, ~1 us worth of bandwidth. `linear_many` runs q, k and v as one grid, so k and v
ride along with q's tiles; `linear` is its one-weight case (the o projection).

Backend: **Pallas-Triton** (deprecated from JAX 0.11), like the other kernels here: a streaming
GEMV/skinny GEMM whose speed comes from Triton's software pipeline keeping several weight tiles in
flight; it runs in CPU interpret mode, so CI tests this exact kernel.

Design: grid `(block_n-row tiles of all weights' outputs, K splits)`. The tiles are numbered weight
after weight (static boundaries); a program finds its weight from its tile index and loops over its
share of the input features in `block_k` steps: the `[rows, block_k]` activation tile (rows padded
to >= 16 so `dot` maps to tensor cores) times the `[block_n, block_k]` weight tile, fp32
accumulation, and writes a partial sum into that weight's output; the splits' sum and the bias fuse
into the consumer. Splitting K matters: one program per tile walking all of K is latency-bound (each
step waits on its load), measured at ~11 us whatever the projection's size. Outputs fp32, like the
`einsum(..., preferred_element_type=f32)` they replace.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import layer_index

MAX_ROWS = 64  # the row tiles it is built and measured for; beyond, the weight is amortised enough for XLA's GEMM
SMEM_BYTES = 200 * 1024  # of the H100/H200's 227 KiB per block, leaving room for Triton's own scratch


def reference(x_TI, w_LOI, b_O, layer):
    """The same function in plain JAX (XLA copies the layer slice first)."""
    w = jax.lax.dynamic_index_in_dim(w_LOI, layer_index.value(layer), 0, keepdims=False)
    y = jnp.einsum("ti,oi->to", x_TI, w, preferred_element_type=jnp.float32)
    return y + b_O.astype(jnp.float32)


def _kernel(layer_ref, map_ref, live_ref, x_ref, *refs, rows, bn, bk, per, K, Os):
    """One `[rows, bn]` output tile over one K split. `refs` are the weights then their outputs; the
    tile index picks the weight (a `switch` on static boundaries: one branch runs, none for 1 weight). A step that is
    not live (`layer_index.live`) loads no weight and stores zeros."""
    w_refs, y_refs = refs[: len(Os)], refs[len(Os) :]
    first = [sum(pl.cdiv(O, bn) for O in Os[:i]) for i in range(len(Os))]  # each weight's first tile
    tile, split = pl.program_id(0), pl.program_id(1)
    layer, live = layer_index.read(layer_ref, map_ref), layer_index.live(live_ref)
    row_ok = jnp.arange(rows) < x_ref.shape[0]  # rows beyond T load as zeros: no padded copy of x

    def project(i):
        n0 = pl.multiple_of((tile - first[i]) * bn, bn)
        col_ok = n0 + jnp.arange(bn) < Os[i]

        def body(s, acc):
            k0 = pl.multiple_of((split * per + s) * bk, bk)
            k_ok = k0 + jnp.arange(bk) < K
            x = plt.load(x_ref.at[pl.ds(0, rows), pl.ds(k0, bk)], mask=row_ok[:, None] & k_ok[None, :], other=0)
            # a step that is not live reads no weight: its loads are masked off (zeros), not branched around, so
            # the loop and its software pipeline stay as they are
            w_ok = (col_ok[:, None] & k_ok[None, :]) & live
            w = plt.load(w_refs[i].at[layer, pl.ds(n0, bn), pl.ds(k0, bk)], mask=w_ok, other=0)
            return acc + jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, per, body, jnp.zeros((rows, bn), jnp.float32))
        plt.store(y_refs[i].at[split, pl.ds(0, rows), pl.ds(n0, bn)], acc, mask=row_ok[:, None] & col_ok[None, :])

    which = sum((tile >= f).astype(jnp.int32) for f in first[1:])
    jax.lax.switch(which, [functools.partial(project, i) for i in range(len(Os))])


def split_k(O: int, K: int, block_n: int, block_k: int, programs: int) -> tuple[int, int]:
    """(splits, K steps per split): enough programs to keep ~`programs` weight tiles streaming at once.
    One program walking all of K serialises its loads (latency-bound: ~11 us for any 20b projection)."""
    tiles, steps = pl.cdiv(O, block_n), pl.cdiv(K, block_k)
    splits = min(steps, max(1, pl.cdiv(programs, tiles)))
    per = pl.cdiv(steps, splits)
    return pl.cdiv(steps, per), per


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "programs", "num_warps", "num_stages", "interpret"))
def partial_sums(
    x_TI, ws_LOI, layer, *, block_n=32, block_k=128, programs=1056, num_warps=4, num_stages=3, interpret=None
):
    """`x_TI @ w[layer].T` for each weight of `ws_LOI` (same I and dtype), in one launch, for T <= MAX_ROWS
    rows, as fp32 partial sums `[splits, T, O]` over the K splits (`split_k`, counting all weights' tiles):
    summing them is left to the consumer, which fuses it with the bias and whatever comes next. The launch
    settings' defaults are `KernelConfig`'s (`linear_*`)."""
    T, K = x_TI.shape
    Os = tuple(w.shape[1] for w in ws_LOI)
    assert T <= MAX_ROWS, T
    assert all(w.shape[2] == K and w.dtype == ws_LOI[0].dtype for w in ws_LOI), [w.shape for w in ws_LOI]
    rows = max(16, pl.next_power_of_2(T))
    tiles = sum(pl.cdiv(O, block_n) for O in Os)
    splits, per = split_k(tiles * block_n, K, block_n, block_k, programs)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    # Triton gives every weight's branch its own pipeline buffers: keep their sum within shared memory.
    stage_bytes = len(Os) * (rows + block_n) * block_k * jnp.dtype(ws_LOI[0].dtype).itemsize
    num_stages = max(1, min(num_stages, SMEM_BYTES // stage_bytes))
    return pl.pallas_call(
        functools.partial(_kernel, rows=rows, bn=block_n, bk=block_k, per=per, K=K, Os=Os),
        grid=(tiles, splits),
        out_shape=tuple(jax.ShapeDtypeStruct((splits, T, O), jnp.float32) for O in Os),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="decode_linear" if len(Os) == 1 else f"decode_linear_x{len(Os)}",
    )(*layer_index.operands(layer), layer_index.live_operand(layer), x_TI.astype(ws_LOI[0].dtype), *ws_LOI)


def linear_many(x_TI, ws_LOI, bs_O, layer, **config):
    """`reference(x_TI, w_LOI, b_O, layer)` for each weight of `ws_LOI` with its bias from `bs_O`, in one
    launch -> tuple of fp32 `[T, O]`: `partial_sums` (`config` as there), summed with the bias by the
    consumers' XLA fusions."""
    ys = partial_sums(x_TI, tuple(ws_LOI), layer, **config)
    return tuple(jnp.sum(y, axis=0) + b.astype(jnp.float32) for y, b in zip(ys, bs_O))


def linear(x_TI, w_LOI, b_O, layer, **config):
    """`reference(x_TI, w_LOI, b_O, layer)` for T <= MAX_ROWS rows -> fp32 `[T, O]`: `linear_many` of
    one weight; `config` as there."""
    return linear_many(x_TI, (w_LOI,), (b_O,), layer, **config)[0]
