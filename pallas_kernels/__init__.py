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


def prepare_params(params, impl: str):
    """Parameters in the layout `impl` reads: the kernels take the experts re-encoded (same bytes).

    Converts one layer at a time into a donated buffer, so the peak is the experts twice plus one
    layer (converting all layers at once needs several times their size, which 120b cannot afford)."""
    if check_impl(impl) == "reference":
        return params
    experts = params.layers.experts
    one = jax.jit(lambda ex, l: moe_decode.prepare_experts(jax.tree.map(lambda a: a[l], ex)))
    out = jax.tree.map(lambda s: jnp.zeros((experts.gate_up_blocks.shape[0],) + s.shape, s.dtype),
                       jax.eval_shape(one, experts, 0))
    put = jax.jit(lambda o, x, l: jax.tree.map(lambda a, b: a.at[l].set(b), o, x), donate_argnums=0)
    for layer in range(experts.gate_up_blocks.shape[0]):
        out = put(out, one(experts, layer), layer)
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
