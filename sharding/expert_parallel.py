"""Expert parallelism: each device of the `model` axis holds `E / model` experts.

Every device routes its own tokens; two ways to bring each (token, expert) pair to the device that
owns the expert (`Layout.dispatch`):

* `all_gather`: gather all tokens of the `model` group and their routing, apply the local experts to
  the pairs that are local (the others get weight 0), and sum the partial outputs back with a
  reduce-scatter. Volume per device ~ all tokens of the group, whatever the routing.
* `all_to_all`: send each pair only to its expert's device and the results back
  (`sharding.a2a_dispatch`, `jax.lax.ragged_all_to_all`). Volume ~ the device's own tokens x top-k.

When tokens are replicated over `model` (after tensor-parallel attention, low latency) nothing needs
to move: every device applies its local experts to the local pairs and an all-reduce sums them, for
both settings. No collective uses NVLink multicast.

The local experts run through `pallas_kernels.experts` (`kernels`: which MoE kernels, or the
reference), reading the stacked `[L, E/model, ...]` shard at the traced `layer` in place. Expert
counts that do not divide the axis are padded with zero experts the router never selects (router
weights are not padded, so their ids never appear).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import pallas_kernels
from pallas_kernels import moe_reference
from sharding import a2a_dispatch, ragged


def padded_count(num_experts: int, model_size: int) -> int:
    return -(-num_experts // model_size) * model_size


def pad_experts(experts, model_size: int, axis: int = 1):
    """Append zero experts along `axis` (1 for stacked layers) up to a multiple of `model_size`. Works for
    either expert layout (`params.Experts`, `expert_format.KernelExperts`): a zero expert is zero in both."""
    E = jax.tree.leaves(experts)[0].shape[axis]
    extra = padded_count(E, model_size) - E
    if extra == 0:
        return experts

    def pad(x):
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, extra)
        return jnp.pad(x, widths)

    return jax.tree.map(pad, experts)


def mask_pairs(local_TK, mine_TK, w_TK):
    """Weight 0 and a valid local id for the pairs this device does not own: the kernels skip them
    (`valid_TK`), the reference path computes them against an expert routed here anyway (weights
    already in cache), or local expert 0 when none is."""
    fill = jnp.where(mine_TK.any(), local_TK.reshape(-1)[jnp.argmax(mine_TK.reshape(-1))], 0)
    return jnp.where(mine_TK, local_TK, fill), jnp.where(mine_TK, w_TK, 0.0)


def moe(
    x_TD: jax.Array,
    router_w_ED: jax.Array,
    router_b_E: jax.Array,
    experts_all,
    layer,
    *,
    top_k: int,
    swiglu_limit: float,
    swiglu_alpha: float,
    layout,
    kernels: pallas_kernels.KernelConfig = pallas_kernels.REFERENCE,
) -> jax.Array:
    """The MoE block with experts split over the layout's `model` axis; tokens `x_TD` split over the ranks
    as `layout.batch_spec()` says. `experts_all` is stacked over layers (`[L, E_padded, ...]`, in the
    layout `kernels` read), expert axis split over `model`; `layer` (traced) picks the layer."""
    token_axes = layout.batch_spec()[0]
    split = "model" in (token_axes if isinstance(token_axes, tuple) else (token_axes,))
    emulate = not ragged.native(layout.mesh)
    apply = functools.partial(
        pallas_kernels.experts, swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha, kernels=kernels
    )

    def local(x, rw, rb, ex, layer):
        idx, w, _ = moe_reference.route(x, rw, rb, top_k)
        num_local = jax.tree.leaves(ex)[0].shape[1]
        run = lambda x, local_TK, mine_TK, w_TK: apply(x, *mask_pairs(local_TK, mine_TK, w_TK), ex, layer, mine_TK)
        if split and layout.dispatch == "all_to_all":
            with jax.named_scope("moe_all_to_all"):
                y = a2a_dispatch.moe(x, idx, w, run, num_local=num_local, emulate=emulate)
            return y.astype(x.dtype)
        with jax.named_scope("moe_all_gather"):
            if split:
                x, idx, w = (jax.lax.all_gather(a, "model", tiled=True) for a in (x, idx, w))
            local_TK = idx - jax.lax.axis_index("model") * num_local
            y = run(x, local_TK, (local_TK >= 0) & (local_TK < num_local), w)
            y = jax.lax.psum_scatter(y, "model", tiled=True) if split else jax.lax.psum(y, "model")
        return y.astype(x.dtype)

    ex_specs = jax.tree.map(lambda _: P(None, "model"), experts_all)
    fn = jax.shard_map(
        local,
        mesh=layout.mesh,
        in_specs=(P(token_axes), P(), P(), ex_specs, P()),
        out_specs=P(token_axes),
        check_vma=False,
    )
    return fn(x_TD, router_w_ED, router_b_E, experts_all, layer)
