"""All-to-all token dispatch for expert parallelism (inside `shard_map`, tokens split over `model`).

Each device sorts its (token, expert) pairs by the device owning the expert, sends each pair's
activation (with its local expert id packed into extra columns) only there with one
`ragged_all_to_all`, applies its local experts to what it received, and sends the unweighted
results back with a second one; the source combines them with its routing weights in fp32.

No pair is ever dropped: a device receives at most `n * T * min(k, E_local)` pairs (every token of
the group routed to its experts), and its receive buffer has that many rows. The rows past what
arrived are marked invalid (weight 0): the MoE kernels skip them (`valid_TK`), so the routing, not the
buffer's size, sets the expert compute; the reference path computes them at weight 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import moe_slots
from sharding import ragged


def capacity(tokens: int, top_k: int, num_local: int, n: int) -> int:
    """Rows of a device's receive buffer: the most pairs the group's routing can send it."""
    return n * tokens * min(top_k, num_local)


def _exclusive_cumsum(a, axis=0):
    return jnp.cumsum(a, axis=axis) - a


def _pack_ids(ids_P, dtype):
    """int32 ids as extra columns of `dtype` (bit-cast: collectives and selects copy the bits)."""
    return jax.lax.bitcast_convert_type(ids_P, dtype).reshape(ids_P.shape[0], -1)


def _unpack_ids(cols_RC):
    return jax.lax.bitcast_convert_type(cols_RC[:, 0] if cols_RC.shape[1] == 1 else cols_RC, jnp.int32)


def moe(x_TD, idx_TK, w_TK, apply, *, num_local: int, emulate: bool, axis: str = "model"):
    """`sum_k w[t, k] * expert_{idx[t, k]}(x[t])` (fp32 `[T, D]`) for this device's tokens, the experts
    split over `axis` (`num_local` each). `apply(x_RD, local_ids_R1, valid_R1, w_R1)` runs the local experts
    on the received rows (fp32); rows past those that arrived are not valid."""
    T, k = idx_TK.shape
    D = x_TD.shape[1]
    n, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    P = T * k
    dest_P = idx_TK.reshape(P) // num_local
    order = moe_slots.stable_order(dest_P, n)
    send_n = jnp.zeros((n,), jnp.int32).at[dest_P].add(1)
    sizes_nn = jax.lax.all_gather(send_n, axis)  # [source, destination] pair counts of the group
    send_off = _exclusive_cumsum(send_n)
    recv_n = sizes_nn[:, me]
    recv_off = _exclusive_cumsum(recv_n)  # where each source's pairs sit in my receive buffer
    at_dest = _exclusive_cumsum(sizes_nn)[me]  # where mine sit in each destination's buffer
    at_src = _exclusive_cumsum(sizes_nn, axis=1)[:, me]  # where each source keeps the pairs it sent me

    # Forward: activations plus the local expert id, bit-cast into extra columns of the same dtype.
    ids_P = (idx_TK.reshape(P) % num_local)[order].astype(jnp.int32)
    send = jnp.concatenate([x_TD[order // k], _pack_ids(ids_P, x_TD.dtype)], axis=1)
    R = capacity(T, k, num_local, n)
    got = ragged.all_to_all(
        send,
        jnp.zeros((R, send.shape[1]), send.dtype),
        send_off,
        send_n,
        at_dest,
        recv_n,
        axis_name=axis,
        emulate=emulate,
    )
    arrived_R1 = (jnp.arange(R) < jnp.sum(recv_n))[:, None]
    y_RD = apply(got[:, :D], _unpack_ids(got[:, D:])[:, None], arrived_R1, jnp.ones((R, 1), jnp.float32))
    y_RD = y_RD.astype(x_TD.dtype)

    # Back: each source's results return to where it kept the pairs, then to token order.
    back = ragged.all_to_all(
        y_RD, jnp.zeros((P, D), y_RD.dtype), recv_off, recv_n, at_src, send_n, axis_name=axis, emulate=emulate
    )
    y_PD = jnp.zeros_like(back).at[order].set(back).astype(jnp.float32)
    return jnp.sum(y_PD.reshape(T, k, D) * w_TK.astype(jnp.float32)[:, :, None], axis=1)  # exact fp32, no dot
