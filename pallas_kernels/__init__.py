"""The two hot operations of gpt-oss, each with a pure-JAX reference beside its Pallas kernels.

`attention` and `moe` are the only entry points the model calls; `impl` picks the implementation:
`"pallas"` (the kernels; the default on GPUs) or `"reference"` (pure JAX; the default elsewhere,
since the Pallas-Triton kernels only lower for GPUs and would run interpreted). The kernels read
the experts in their own relayout of the same bytes, made once at start-up by `prepare_params`.
"""

import jax
import jax.numpy as jnp

from pallas_kernels import (attention_reference, flash_attention, moe_decode, moe_prefill, moe_reference,
                            paged_attention)

IMPLS = ("reference", "pallas")


def default_impl() -> str:
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def check_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"unknown kernel implementation '{impl}'; choose one of {IMPLS}")
    return impl


def prepare_params(params, impl: str, experts_per_chunk: int = 16):
    """Parameters in the layout `impl` reads: the kernels take the experts re-encoded (same bytes).

    Converts `experts_per_chunk` experts of one layer at a time into a donated buffer, so the peak is
    the experts twice plus one chunk's temporaries (a whole 120b layer at once needs ~18 GB of them)."""
    if check_impl(impl) == "reference":
        return params
    experts = params.layers.experts
    L, E = experts.gate_up_blocks.shape[:2]
    c = min(E, experts_per_chunk)
    while E % c:
        c -= 1
    one = jax.jit(lambda ex, l, e0: moe_decode.prepare_experts(
        jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a[l], e0, c), ex)))
    chunk = jax.eval_shape(one, experts, 0, 0)
    out = jax.tree.map(lambda s: jnp.zeros((L, E) + s.shape[1:], s.dtype), chunk)
    put = jax.jit(lambda o, x, l, e0: jax.tree.map(
        lambda a, b: jax.lax.dynamic_update_slice(a, b[None], (l, e0) + (0,) * (a.ndim - 2)), o, x),
        donate_argnums=0)
    for layer in range(L):
        for e0 in range(0, E, c):
            out = put(out, one(experts, layer, e0), layer, e0)
    return params.replace(layers=params.layers.replace(experts=out))


def attention(q_BTNH, k_pages_PSKH, v_pages_PSKH, block_tables_BM, q_pos_BT, sinks_N, window: int, *,
              impl: str = "reference"):
    """Paged attention with sinks; the contract is in docs/engine.md ("Kernel interface")."""
    args = (q_BTNH, k_pages_PSKH, v_pages_PSKH, block_tables_BM, q_pos_BT, sinks_N, window)
    if check_impl(impl) == "reference":
        return attention_reference.attention(*args)
    kernel = paged_attention if q_BTNH.shape[1] == 1 else flash_attention  # decode / prefill chunk
    return kernel.attention(*args)


def moe(x_TD, router_w_ED, router_b_E, experts, *, top_k, swiglu_limit, swiglu_alpha, layer=None,
        impl: str = "reference"):
    """Top-k MXFP4 experts; `experts` is `params.Experts` (reference) or `KernelExperts` (pallas), of one
    layer, or of all layers stacked with `layer` (traced) choosing one: the kernels then index the
    stacked arrays directly, so no per-layer copy of the experts is made."""
    kw = dict(top_k=top_k, swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha)
    if check_impl(impl) == "pallas":
        return moe_prefill.moe_auto(x_TD, router_w_ED, router_b_E, experts, layer=layer, **kw)
    if layer is not None:
        experts = jax.tree.map(lambda a: a[layer], experts)
    return moe_reference.moe(x_TD, router_w_ED, router_b_E, experts, **kw)
