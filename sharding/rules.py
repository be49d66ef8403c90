"""The one table mapping logical axes to mesh axes, per parallelism mode.

A mesh has two axes: `replica` (independent data-parallel copies of the model) and `model` (the
devices that hold one copy). The two modes follow TensorRT-LLM's gpt-oss profiles:

* `low_latency`: attention tensor-parallel (heads over `model`), experts expert-parallel.
* `max_throughput`: attention data-parallel (tokens over `model`), experts expert-parallel.

Logical axes not listed are replicated. KV heads are replicated when `model` exceeds their count
(8 for gpt-oss), while query heads stay split.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from gptoss_jax import params as params_lib

MODES = ("low_latency", "max_throughput")

RULES = {
    "low_latency": {
        "batch": "replica",
        "q_heads": "model", "heads": "model", "kv_heads": "model",
        "experts": "model",
        "vocab": "model",
    },
    "max_throughput": {
        "batch": ("replica", "model"),
        "experts": "model",
        "vocab": "model",
    },
}


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh plus a mode: everything needed to place parameters, caches and activations."""
    mesh: Mesh
    mode: str

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown parallelism mode '{self.mode}'; choose one of {MODES}")
        if set(self.mesh.axis_names) != {"replica", "model"}:
            raise ValueError(f"mesh axes must be ('replica', 'model'), got {self.mesh.axis_names}")

    @property
    def model_size(self) -> int:
        return self.mesh.shape["model"]

    def rules(self, num_kv_heads: int) -> dict:
        rules = dict(RULES[self.mode])
        if rules.get("kv_heads") and num_kv_heads % self.model_size:
            rules["kv_heads"] = None  # more devices than KV heads: replicate K/V, keep Q split
        return rules

    def spec(self, logical: tuple, num_kv_heads: int) -> P:
        rules = self.rules(num_kv_heads)
        return P(*(rules.get(axis) if axis else None for axis in logical))

    def sharding(self, logical: tuple, num_kv_heads: int) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical, num_kv_heads))

    def param_shardings(self, num_kv_heads: int) -> params_lib.Params:
        """A `Params`-shaped tree of `NamedSharding`s."""
        return jax.tree.map(lambda axes: self.sharding(axes, num_kv_heads), params_lib.logical_axes(),
                            is_leaf=lambda x: isinstance(x, tuple))


def make_mesh(model: int, replicas: int = 1, devices=None) -> Mesh:
    """A `(replica, model)` mesh over the first `model * replicas` devices."""
    devices = list(devices if devices is not None else jax.devices())
    need = model * replicas
    if need > len(devices):
        raise ValueError(f"mesh ({replicas} replicas x {model} model) needs {need} devices; {len(devices)} available")
    # Auto axes: XLA propagates shardings from parameters and caches (GSPMD) and shard_map reshards
    # its inputs, so call sites need no explicit resharding.
    return jax.make_mesh((replicas, model), ("replica", "model"), devices=devices[:need],
                         axis_types=(AxisType.Auto, AxisType.Auto))
