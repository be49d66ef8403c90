"""`jax.lax.ragged_all_to_all`, with an emulation for backends that cannot compile it.

XLA:CPU has no lowering for `ragged-all-to-all` (jax 0.11.2: UNIMPLEMENTED), so the CPU tests and
tools would not run the all-to-all dispatch at all. `emulated` computes the same result from an
all-gather and local gathers (every device receives every operand: fine for simulated devices, a
waste of bandwidth anywhere real), following the receive side of `ragged_all_to_all`'s documented
semantics exactly: received slice `i` comes from device `i // (N / n)`, lands at
`all_to_all(output_offsets)[i]` with `recv_sizes[i]` rows, and later slices win where two overlap.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def native(mesh) -> bool:
    """Whether XLA compiles `ragged_all_to_all` for the mesh's devices: GPUs yes, XLA:CPU no."""
    return mesh.devices.flat[0].platform == "gpu"


def all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name: str, emulate: bool
):
    """`jax.lax.ragged_all_to_all` over `axis_name` (inside `shard_map`), or `emulated` when `emulate`."""
    fn = emulated if emulate else jax.lax.ragged_all_to_all
    return fn(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name)


EMULATED_SCOPE = "emulated_ragged_all_to_all_sends"  # named scope: f"{EMULATED_SCOPE}_{rows}_rows"


def emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name: str):
    """`ragged_all_to_all` from `all_gather` + gathers; same operands, same result. Its collectives run under a
    named scope saying how many rows the real one moves per device at most on average (a device sends at most its
    operand's rows, receives at most its output's), so that `tools.plan_mesh` counts the real op, not these."""
    with jax.named_scope(f"{EMULATED_SCOPE}_{min(operand.shape[0], output.shape[0])}_rows"):
        return _emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name)


def _emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name: str):
    n = jax.lax.axis_size(axis_name)
    N = input_offsets.shape[0]
    if N % n:
        raise ValueError(f"ragged all-to-all: {N} slices do not divide over the {n} devices of '{axis_name}'")
    m = N // n  # slices per destination device
    me = jax.lax.axis_index(axis_name)
    ops = jax.lax.all_gather(operand, axis_name)  # [n, rows, ...]
    in_off = jax.lax.all_gather(input_offsets, axis_name)  # [n, N]
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where my received slices land
    rows = jnp.arange(output.shape[0])
    result = output
    for i in range(N):  # received slice i: slice me * m + i % m of device i // m
        src, start = i // m, in_off[i // m, me * m + i % m]
        take = (rows >= at[i]) & (rows < at[i] + recv_sizes[i])
        got = ops[src][jnp.clip(start + rows - at[i], 0, operand.shape[0] - 1)]
        result = jnp.where(take.reshape((-1,) + (1,) * (output.ndim - 1)), got, result)
    return result
