"""A step's host arrays as one transfer: packed into one int32 buffer on the host, sliced back inside the step.

Each host array sent alone costs its own transfer call and stream callback (~0.1-0.2 ms each on the H200 machine's
host), and a batch-1 prefill's first kernel waits for all ~15 of its arrays (docs/BENCHMARKS.md §35). Packed, the
batch is one copy; the slices and bit casts back are free inside the compiled step (`unpack`, its first line).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

WORD_DTYPES = ("int32", "uint32", "float32", "bool")  # the batches' host dtypes; bool travels as 0 / 1


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one packed array lies in the words."""

    offset: int
    shape: tuple[int, ...]
    dtype: str


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Packed:
    """A batch whose host arrays are `words` (i32 `[N]`); `others` are its other leaves (device arrays), in order.
    `layout` (static: part of a compiled step's key) is the batch's tree and, per leaf, its `Slot` or None (the
    next of `others`)."""

    words: Any
    others: tuple
    layout: tuple

    def tree_flatten(self):
        return (self.words, self.others), self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        return cls(*children, layout)


def pack(batch) -> Packed:
    """`batch` (a pytree) with its numpy arrays packed into one host buffer; other leaves are kept as they are."""
    leaves, treedef = jax.tree.flatten(batch)
    parts, slots, others, n = [], [], [], 0
    for x in leaves:
        if not isinstance(x, np.ndarray):
            slots.append(None)
            others.append(x)
            continue
        if x.dtype.name not in WORD_DTYPES:
            raise TypeError(f"a step's host array of dtype {x.dtype} cannot be packed (expected one of {WORD_DTYPES})")
        words = x.astype(np.int32) if x.dtype == bool else np.ascontiguousarray(x).view(np.int32)
        parts.append(words.reshape(-1))
        slots.append(Slot(n, tuple(x.shape), x.dtype.name))
        n += words.size
    words = np.concatenate(parts) if parts else np.zeros((0,), np.int32)
    return Packed(words, tuple(others), (treedef, tuple(slots)))


def unpack(batch):
    """The batch a `Packed` holds (inside a step: slices of the words); anything else as it is."""
    if not isinstance(batch, Packed):
        return batch
    treedef, slots = batch.layout
    others = iter(batch.others)
    leaves = []
    for s in slots:
        if s is None:
            leaves.append(next(others))
            continue
        w = jax.lax.slice(batch.words, (s.offset,), (s.offset + math.prod(s.shape),)).reshape(s.shape)
        if s.dtype == "bool":
            w = w != 0
        elif s.dtype != "int32":
            w = jax.lax.bitcast_convert_type(w, np.dtype(s.dtype))
        leaves.append(w)
    return treedef.unflatten(leaves)
