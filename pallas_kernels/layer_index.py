"""Which layer of the stacked arrays a kernel reads: the layer scan's counter `i` and a map, layer `stride * i +
offset` and, in a pool of all layers of its type, first page `pages * i + first_page`.

Why: the decode kernels read their layer's weights, biases and cache pages in place, so each takes its layer as a
scalar operand. Computed by XLA from the scan's counter (`2i + 1`; the attention kernel's stacked `[page offset,
layer]`), those scalars were four one-thread kernels a layer pair on the decode step's critical path, ~1.1 us each
plus the gaps around them (docs/BENCHMARKS.md §26.6; gone in §28). Given the counter and the map, a constant of the
program, each kernel computes them in its own scalar code; the map is an operand, not part of the kernel's code, so
the sliding and the full layers share one compiled kernel. An int or a traced scalar is a layer of its own (stride 1,
offset 0), so callers outside the scan pass plain layer numbers.

It also says whether the step is live. A multi-step decode call runs all its steps whatever its rows' length limits,
so a request ended by length spent 0-7 steps of its last call, 3.5 on average (~3% of a 256-token batch-1 request,
docs/BENCHMARKS.md §25). Such steps have only padding positions (`gptoss_jax.steps.useful`), and the kernels that stream
weights (the projections and the routed experts) read none there. The flag is a third operand, computed once a step
outside the scan: carried inside the counter, its `[1, 0]` increment cost a kernel a layer pair (§29).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerIndex:
    i: jax.Array  # int32 scalar, traced: the layer scan's counter
    stride: int = dataclasses.field(default=1, metadata=dict(static=True))
    offset: int = dataclasses.field(default=0, metadata=dict(static=True))
    pages: int = dataclasses.field(default=0, metadata=dict(static=True))  # per counter step in its type's pool
    first_page: int = dataclasses.field(default=0, metadata=dict(static=True))  # at counter 0
    live: jax.Array | None = None  # int32 [1], traced: 0 where the step has no token (`live_operand`); None: live

    def value(self) -> jax.Array:
        """The layer number (jnp: XLA fuses it into its consumers)."""
        return self.stride * self.i + self.offset

    def page_offset(self) -> jax.Array:
        """The layer's first page in its type's pool of all layers (jnp)."""
        return self.pages * self.i + self.first_page


def of(layer) -> LayerIndex:
    """`layer` as a `LayerIndex`: an int or a scalar array is its own counter."""
    return layer if isinstance(layer, LayerIndex) else LayerIndex(jnp.asarray(layer, jnp.int32))


def value(layer) -> jax.Array:
    """The layer number of `layer` (a `LayerIndex`, an int or a scalar array), for jnp code."""
    return of(layer).value()


def operands(layer, page_offset=None) -> tuple[jax.Array, jax.Array]:
    """A kernel's two int32 operands for `layer`: the counter `[1]` and the map `[4]` (stride, offset, pages, first
    page), read back by `read` and `read_page_offset`. The map is a constant unless `page_offset` is given (then it
    replaces the layer's `pages * i + first_page`)."""
    layer = of(layer)
    i = jnp.asarray(layer.i, jnp.int32).reshape(1)
    if page_offset is None:
        return i, jnp.asarray([layer.stride, layer.offset, layer.pages, layer.first_page], jnp.int32)
    fixed = jnp.asarray([layer.stride, layer.offset, 0], jnp.int32)
    return i, jnp.concatenate([fixed, jnp.asarray(page_offset, jnp.int32).reshape(1)])


def live_operand(layer) -> jax.Array:
    """The int32 `[1]` operand of the kernels that skip a step with no token: 1 where live, read by `live`."""
    live = of(layer).live
    return jnp.ones((1,), jnp.int32) if live is None else jnp.asarray(live, jnp.int32).reshape(1)


def read(i_ref, map_ref):
    """Inside a kernel: the layer number from `operands`' refs."""
    return i_ref[0] * map_ref[0] + map_ref[1]


def read_page_offset(i_ref, map_ref):
    """Inside a kernel: the layer's first page from `operands`' refs."""
    return i_ref[0] * map_ref[2] + map_ref[3]


def live(live_ref):
    """Inside a kernel: whether the step has a token (`live_operand`). Where not, the kernel reads no weight and
    writes zeros, so that the step's later kernels read finite values."""
    return live_ref[0] != 0
