"""Which layer of the stacked arrays a kernel reads: the layer scan's counter `i` and a map, layer `stride * i +
offset` and, in a pool of all layers of its type, first page `pages * i`.

Why: the decode kernels read their layer's weights, biases and cache pages in place, so each takes its layer as a
scalar operand. Computed by XLA from the scan's counter (`2i + 1`; the attention kernel's stacked `[page offset,
layer]`), those scalars were four one-thread kernels a layer pair on the decode step's critical path, ~1.1 us each
plus the gaps around them (docs/BENCHMARKS.md §26.6; gone in §28). Given the counter and the map, a constant of the
program, each kernel computes them in its own scalar code; the map is an operand, not part of the kernel's code, so
the sliding and the full layers share one compiled kernel. An int or a traced scalar is a layer of its own (stride 1,
offset 0), so callers outside the scan pass plain layer numbers.

The counter also says whether the step is live: a multi-step decode call runs its steps whatever its rows' length
limits, so a request ended by length wasted 0-7 steps of its last call, 3.5 on average (~3% of a 256-token batch-1
request, docs/BENCHMARKS.md §25). Such steps now have only padding positions (`steps`), and their weight-streaming
kernels (the projections and the routed experts) read no weight.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerIndex:
    counter: jax.Array  # int32 [2], traced: the layer scan's counter i, and whether the step is live (`counter`)
    stride: int = dataclasses.field(default=1, metadata=dict(static=True))
    offset: int = dataclasses.field(default=0, metadata=dict(static=True))
    pages: int = dataclasses.field(default=0, metadata=dict(static=True))  # per layer in its type's pool

    @property
    def i(self) -> jax.Array:
        return self.counter[0]

    def value(self) -> jax.Array:
        """The layer number (jnp: XLA fuses it into its consumers)."""
        return self.stride * self.i + self.offset

    def page_offset(self) -> jax.Array:
        """The layer's first page in its type's pool of all layers (jnp)."""
        return self.pages * self.i


def counter(i, live=True) -> jax.Array:
    """The counter a layer scan carries, int32 `[2]`: `i`, and 1 where the step is live, 0 where it has no token
    (every position is padding: a multi-step call's steps past its rows' length limits), whose kernels then skip
    their weight reads (`live`). The scan adds `[1, 0]` a layer pair: one increment, as for a scalar counter."""
    return jnp.stack([jnp.asarray(i, jnp.int32), jnp.asarray(live, jnp.int32)])


def of(layer) -> LayerIndex:
    """`layer` as a `LayerIndex`: an int or a scalar array is its own counter, live."""
    return layer if isinstance(layer, LayerIndex) else LayerIndex(counter(layer))


def value(layer) -> jax.Array:
    """The layer number of `layer` (a `LayerIndex`, an int or a scalar array), for jnp code."""
    return of(layer).value()


def operands(layer, page_offset=None) -> tuple[jax.Array, jax.Array]:
    """A kernel's two int32 operands for `layer`: the counter `[2]` and the map `[4]` (stride, offset, pages, first
    page), read back by `read`, `read_page_offset` and `live`. The map is a constant unless `page_offset` is given
    (then it replaces the layer's `pages * i`)."""
    layer = of(layer)
    if page_offset is None:
        return layer.counter, jnp.asarray([layer.stride, layer.offset, layer.pages, 0], jnp.int32)
    fixed = jnp.asarray([layer.stride, layer.offset, 0], jnp.int32)
    return layer.counter, jnp.concatenate([fixed, jnp.asarray(page_offset, jnp.int32).reshape(1)])


def read(c_ref, map_ref):
    """Inside a kernel: the layer number from `operands`' refs."""
    return c_ref[0] * map_ref[0] + map_ref[1]


def read_page_offset(c_ref, map_ref):
    """Inside a kernel: the layer's first page from `operands`' refs."""
    return c_ref[0] * map_ref[2] + map_ref[3]


def live(c_ref):
    """Inside a kernel: whether the step has a token (`counter`); where not, the kernel skips its weight reads and
    writes zeros, so that the step's later kernels read finite values."""
    return c_ref[1] != 0
