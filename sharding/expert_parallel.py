"""Expert parallelism: each device of the `model` axis holds `E / model` experts.

Dispatch is all-gather + reduce-scatter: every device routes its own tokens, gathers all tokens of
the group, applies only its local experts (routing weights of other devices' experts set to 0), and
the partial outputs are summed back with a reduce-scatter (a plain all-reduce when tokens are
replicated, as after tensor-parallel attention). No collective uses NVLink multicast.

Expert counts that do not divide the axis are padded with zero experts that the router never
selects (router weights are not padded, so their ids never appear).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gptoss_jax.params import Experts
from pallas_kernels import moe_reference


def padded_count(num_experts: int, model_size: int) -> int:
    return -(-num_experts // model_size) * model_size


def pad_experts(experts: Experts, model_size: int, axis: int = 1) -> Experts:
    """Append zero experts along `axis` (1 for stacked layers) up to a multiple of `model_size`."""
    E = experts.gate_up_blocks.shape[axis]
    extra = padded_count(E, model_size) - E
    if extra == 0:
        return experts

    def pad(x):
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, extra)
        return jnp.pad(x, widths)

    return jax.tree.map(pad, experts)


def moe(x_TD: jax.Array, router_w_ED: jax.Array, router_b_E: jax.Array, experts: Experts, *, top_k: int,
        swiglu_limit: float, swiglu_alpha: float, mesh, token_axes) -> jax.Array:
    """The MoE block with experts split over the mesh's `model` axis.

    `token_axes` is how the T axis of `x_TD` is split: `("replica", "model")` for data-parallel
    attention (each device has its own tokens), `"replica"` when tokens are replicated over `model`.
    `experts` carries a padded expert axis split over `model`.
    """
    tokens_split_over_model = token_axes is not None and "model" in (
        token_axes if isinstance(token_axes, tuple) else (token_axes,))
    e_spec = P("model")

    def local(x, rw, rb, ex):
        idx, w, _ = moe_reference.route(x, rw, rb, top_k)
        if tokens_split_over_model:
            x = jax.lax.all_gather(x, "model", tiled=True)
            idx = jax.lax.all_gather(idx, "model", tiled=True)
            w = jax.lax.all_gather(w, "model", tiled=True)
        e_local = ex.gate_up_blocks.shape[0]
        local_idx = idx - jax.lax.axis_index("model") * e_local
        mine = (local_idx >= 0) & (local_idx < e_local)
        y = moe_reference.apply_experts(x, jnp.where(mine, local_idx, 0), jnp.where(mine, w, 0.0), ex,
                                        swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha)
        if tokens_split_over_model:
            y = jax.lax.psum_scatter(y, "model", scatter_dimension=0, tiled=True)
        else:
            y = jax.lax.psum(y, "model")
        return y.astype(x.dtype)

    experts_specs = jax.tree.map(lambda _: e_spec, experts)
    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(token_axes), P(), P(), experts_specs),
                       out_specs=P(token_axes), check_vma=False)
    return fn(x_TD, router_w_ED, router_b_E, experts)
