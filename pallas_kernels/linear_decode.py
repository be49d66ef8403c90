"""Dense projection for decode (up to 64 rows): `x @ w[layer].T + b`, reading layer `layer` of the
stacked `[L, O, I]` weight in place.

Why a kernel: the attention projections are 2/3 of the non-expert bytes a decode step reads, and
XLA handles them badly inside the layer scan: the scan slices each layer's weights out of the
stacked arrays into a fresh buffer (a full copy, ~53 MB per 20b layer; 0.84 ms of a 4.5 ms batch-1
step, measured) before cuBLAS reads them again at ~40% of the copy bandwidth. Here the layer index
is an offset into the stacked array, and the weight is streamed once.

Backend: **Pallas-Triton** (deprecated from JAX 0.11), like the other kernels here: a streaming
GEMV/skinny GEMM whose speed comes from Triton's software pipeline keeping several weight tiles in
flight; it runs in CPU interpret mode, so CI tests this exact kernel.

Design: grid `(block_n-row tiles of the output features, K splits)`. Each program loops over its
share of the input features in `block_k` steps: the `[rows, block_k]` activation tile (rows padded
to >= 16 so `dot` maps to tensor cores) times the `[block_n, block_k]` weight tile, fp32
accumulation, and writes a partial sum; the splits' sum and the bias fuse into the consumer.
Splitting K matters: one program per tile walking all of K is latency-bound (each step waits on its
load), measured at ~11 us whatever the projection's size. Output fp32, like the
`einsum(..., preferred_element_type=f32)` it replaces.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

MAX_ROWS = 64  # beyond this the weight is amortised over enough rows for XLA's GEMM


def reference(x_TI, w_LOI, b_O, layer):
    """The same function in plain JAX (XLA copies the layer slice first)."""
    w = jax.lax.dynamic_index_in_dim(w_LOI, layer, 0, keepdims=False)
    y = jnp.einsum("ti,oi->to", x_TI, w, preferred_element_type=jnp.float32)
    return y + b_O.astype(jnp.float32)


def _kernel(layer_ref, x_ref, w_ref, y_ref, *, rows, bn, bk, per, K, O):
    n0 = pl.multiple_of(pl.program_id(0) * bn, bn)
    split = pl.program_id(1)
    layer = layer_ref[0]
    row_ok = jnp.arange(rows) < x_ref.shape[0]  # rows beyond T load as zeros: no padded copy of x
    col_ok = n0 + jnp.arange(bn) < O

    def body(i, acc):
        k0 = pl.multiple_of((split * per + i) * bk, bk)
        k_ok = k0 + jnp.arange(bk) < K
        x = plt.load(x_ref.at[pl.ds(0, rows), pl.ds(k0, bk)], mask=row_ok[:, None] & k_ok[None, :], other=0)
        w = plt.load(w_ref.at[layer, pl.ds(n0, bn), pl.ds(k0, bk)], mask=col_ok[:, None] & k_ok[None, :],
                     other=0)
        return acc + jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, per, body, jnp.zeros((rows, bn), jnp.float32))
    plt.store(y_ref.at[split, pl.ds(0, rows), pl.ds(n0, bn)], acc, mask=row_ok[:, None] & col_ok[None, :])


def split_k(O: int, K: int, block_n: int, block_k: int, programs: int) -> tuple[int, int]:
    """(splits, K steps per split): enough programs to keep ~`programs` weight tiles streaming at once.
    One program walking all of K serialises its loads (latency-bound: ~11 us for any 20b projection)."""
    tiles, steps = pl.cdiv(O, block_n), pl.cdiv(K, block_k)
    splits = min(steps, max(1, pl.cdiv(programs, tiles)))
    per = pl.cdiv(steps, splits)
    return pl.cdiv(steps, per), per


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "programs", "num_warps", "num_stages",
                                             "interpret"))
def linear(x_TI, w_LOI, b_O, layer, *, block_n=32, block_k=256, programs=528, num_warps=4, num_stages=3,
           interpret=None):
    """`reference(x_TI, w_LOI, b_O, layer)` for T <= MAX_ROWS rows -> fp32 `[T, O]`. K is split over
    programs (`split_k`); the partial sums and the bias are added by the consumer's XLA fusion."""
    T, K = x_TI.shape
    O = w_LOI.shape[1]
    assert T <= MAX_ROWS, T
    rows = max(16, pl.next_power_of_2(T))
    splits, per = split_k(O, K, block_n, block_k, programs)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    y = pl.pallas_call(
        functools.partial(_kernel, rows=rows, bn=block_n, bk=block_k, per=per, K=K, O=O),
        grid=(pl.cdiv(O, block_n), splits),
        out_shape=jax.ShapeDtypeStruct((splits, T, O), jnp.float32),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="decode_linear",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), x_TI.astype(w_LOI.dtype), w_LOI)
    return jnp.sum(y, axis=0) + b_O.astype(jnp.float32)
