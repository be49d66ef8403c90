"""The one table mapping logical axes to mesh axes, per parallelism mode.

A mesh has two axes: `replica` (independent data-parallel copies of the model) and `model` (the
devices that hold one copy). The two modes follow TensorRT-LLM's gpt-oss profiles:

* `low_latency`: attention tensor-parallel (heads over `model`), experts expert-parallel.
* `max_throughput`: attention data-parallel (tokens over `model`), experts expert-parallel.

Logical axes not listed are replicated. Heads are split only when `model` divides the KV heads (8 for
gpt-oss), so that each device owns whole GQA groups and runs attention on its own heads; otherwise
attention is replicated over `model`. The layout also names how tokens reach their experts
(`dispatch`, `sharding.expert_parallel`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels import params as params_lib
from sharding import expert_parallel

MODES = ("low_latency", "max_throughput")
DISPATCHES = ("all_gather", "all_to_all")  # expert dispatch (sharding/expert_parallel.py)

RULES = {
    "low_latency": {
        "batch": "replica",
        "pages": "replica",
        "q_heads": "model",
        "heads": "model",
        "kv_heads": "model",
        "experts": "model",
        "vocab": "model",
    },
    # Every device computes its own tokens end to end except the experts, so the embedding and the
    # unembedding are replicated (no per-token collective for the logits; 2 x 1.16 GB bf16 for 120b).
    "max_throughput": {
        "batch": ("replica", "model"),
        "pages": ("replica", "model"),
        "experts": "model",
    },
}


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh plus a mode: everything needed to place parameters, caches and activations."""

    mesh: Mesh
    mode: str
    dispatch: str = "all_gather"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown parallelism mode '{self.mode}'; choose one of {MODES}")
        if self.dispatch not in DISPATCHES:
            raise ValueError(f"unknown expert dispatch '{self.dispatch}'; choose one of {DISPATCHES}")
        if set(self.mesh.axis_names) != {"replica", "model"}:
            raise ValueError(f"mesh axes must be ('replica', 'model'), got {self.mesh.axis_names}")

    @property
    def model_size(self) -> int:
        return self.mesh.shape["model"]

    @property
    def rank_axes(self) -> tuple[str, ...]:
        """Mesh axes of the attention ranks: the device groups that each own their sequences and KV pages."""
        b = RULES[self.mode]["batch"]
        return b if isinstance(b, tuple) else (b,)

    @property
    def num_ranks(self) -> int:
        return int(math.prod(self.mesh.shape[a] for a in self.rank_axes))

    def named(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def batch_spec(self, ndim: int = 1) -> P:
        """Arrays with a leading batch (rows) axis: rows split over the ranks, rank-major."""
        return P(RULES[self.mode]["batch"], *([None] * (ndim - 1)))

    def per_rank(self, fn, in_kinds: tuple, out_kinds: tuple):
        """`fn` run by each attention rank on its own rows (the sampler: `jax.shard_map` manual over the rank
        axes only, `model` left to GSPMD, which keeps the vocabulary split in low latency). Kinds: "rows"
        (leading batch axis), None (same on every rank). With one rank `fn` is returned as is. Attention
        is manual over the whole mesh instead: `sharding.tensor_parallel`."""
        if self.num_ranks == 1:
            return fn
        specs = {"rows": self.batch_spec(), None: P()}
        return jax.shard_map(
            fn,
            mesh=self.mesh,
            in_specs=tuple(specs[k] for k in in_kinds),
            out_specs=specs[out_kinds]
            if isinstance(out_kinds, str) or out_kinds is None
            else tuple(specs[k] for k in out_kinds),
            axis_names=set(self.rank_axes),
            check_vma=False,
        )

    def constrain_rows(self, x: jax.Array) -> jax.Array:
        """Pin an activation's leading (batch) axis to the ranks; other dims left to XLA."""
        return jax.lax.with_sharding_constraint(x, self.named(self.batch_spec(x.ndim)))

    def rules(self, num_kv_heads: int) -> dict:
        rules = dict(RULES[self.mode])
        if rules.get("kv_heads") and num_kv_heads % self.model_size:
            rules.update(q_heads=None, heads=None, kv_heads=None)  # no whole GQA group per device
        return rules

    def spec(self, logical: tuple, num_kv_heads: int, shape: tuple | None = None) -> P:
        """With `shape`, a dimension the mapped mesh axes do not divide is replicated instead (e.g. the
        201,088-row vocabulary over 3 or 9 devices)."""
        rules = self.rules(num_kv_heads)
        out = []
        for i, axis in enumerate(logical):
            mesh_axes = rules.get(axis) if axis else None
            if mesh_axes is not None and shape is not None:
                size = math.prod(
                    self.mesh.shape[a] for a in (mesh_axes if isinstance(mesh_axes, tuple) else (mesh_axes,))
                )
                if shape[i] % size:
                    mesh_axes = None
            out.append(mesh_axes)
        return P(*out)

    def sharding(self, logical: tuple, num_kv_heads: int, shape: tuple | None = None) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical, num_kv_heads, shape))

    def param_shardings(self, num_kv_heads: int, shapes: params_lib.Params | None = None) -> params_lib.Params:
        """A `Params`-shaped tree of `NamedSharding`s. Give `shapes` (arrays or `ShapeDtypeStruct`s, experts
        already padded, in either expert layout) to replicate dimensions the mesh does not divide."""
        axes = params_lib.logical_axes()
        is_axes = lambda x: isinstance(x, tuple)
        if shapes is None:
            return jax.tree.map(lambda a: self.sharding(a, num_kv_heads), axes, is_leaf=is_axes)
        # The kernels' layout (`KernelExperts`): every leaf [L, E, ...], split as the MXFP4 experts (expert-parallel),
        # what the kernels derive from them included (the Mosaic scale operands, the bf16 copy for the grouped
        # prefill GEMMs: `KernelConfig.moe_prefill_bf16_experts`).
        if not isinstance(shapes.layers.experts, params_lib.Experts):
            experts = jax.tree.map(
                lambda s: ("layers", "experts") + (None,) * (len(s.shape) - 2), shapes.layers.experts
            )
            axes = axes.replace(layers=axes.layers.replace(experts=experts))
        return jax.tree.map(lambda a, s: self.sharding(a, num_kv_heads, tuple(s.shape)), axes, shapes, is_leaf=is_axes)

    def cache_sharding(self, num_kv_heads: int) -> NamedSharding:
        """The KV pools `[layers, pages, slot, kv_heads, head_dim]`: pages split over the ranks (each rank
        owns a contiguous range of pages, its own null page first), KV heads over `model` in low latency."""
        return self.sharding(("layers", "pages", None, "kv_heads", None), num_kv_heads)

    def cache_shardings(self, cache, num_kv_heads: int):
        """A sharding for every array of a KV cache (`model.PagedKVCache`, of arrays or shapes), by its
        `logical_axes`: an FP8 cache's values `[layers, pages, kv_heads, head_dim, slot]` and scales `[layers, pages,
        kv_heads, slot]` split as the pools (`cache_sharding`)."""
        axes = cache.logical_axes()
        return jax.tree.map(lambda a: self.sharding(a, num_kv_heads), axes, is_leaf=lambda x: isinstance(x, tuple))

    def padded_shapes(self, shapes: params_lib.Params) -> params_lib.Params:
        """`shapes` (either expert layout) with the expert axis padded to a multiple of the `model` axis."""
        E = jax.tree.leaves(shapes.layers.experts)[0].shape[1]
        Ep = -(-E // self.model_size) * self.model_size
        pad = lambda s: jax.ShapeDtypeStruct((s.shape[0], Ep) + tuple(s.shape[2:]), s.dtype)
        return shapes.replace(layers=shapes.layers.replace(experts=jax.tree.map(pad, shapes.layers.experts)))

    def shard_params(self, params: params_lib.Params, num_kv_heads: int) -> params_lib.Params:
        """Pad the experts (either layout) to the `model` axis and place every leaf by the table (from loaded
        parameters)."""
        params = params.replace(
            layers=params.layers.replace(
                experts=expert_parallel.pad_experts(params.layers.experts, self.model_size, axis=1)
            )
        )
        return jax.device_put(params, self.param_shardings(num_kv_heads, params))


def make_mesh(model: int, replicas: int = 1, devices=None) -> Mesh:
    """A `(replica, model)` mesh over the first `model * replicas` devices."""
    devices = list(devices if devices is not None else jax.devices())
    need = model * replicas
    if need > len(devices):
        raise ValueError(f"mesh ({replicas} replicas x {model} model) needs {need} devices; {len(devices)} available")
    # Auto axes: XLA propagates shardings from parameters and caches (GSPMD) and shard_map reshards
    # its inputs, so call sites need no explicit resharding.
    return jax.make_mesh(
        (replicas, model), ("replica", "model"), devices=devices[:need], axis_types=(AxisType.Auto, AxisType.Auto)
    )


def make_layout(
    model: int = 1, replicas: int = 1, mode: str = "low_latency", devices=None, dispatch: str = "all_gather"
) -> Layout:
    return Layout(make_mesh(model, replicas, devices), mode, dispatch)
