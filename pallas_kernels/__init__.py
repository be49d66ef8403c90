"""The two hot operations of gpt-oss, each with a pure-JAX reference beside its Pallas kernel.

`attention` and `moe` are the only entry points the model calls; `impl` picks the implementation.
"""

from pallas_kernels import attention_reference, moe_reference

IMPLS = ("reference",)


def _check(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"unknown kernel implementation '{impl}'; choose one of {IMPLS}")


def attention(q_BTNH, k_pages_PSKH, v_pages_PSKH, block_tables_BM, q_pos_BT, sinks_N, window: int, *,
              impl: str = "reference"):
    """Paged attention with sinks; the contract is in docs/engine.md ("Kernel interface")."""
    _check(impl)
    return attention_reference.attention(q_BTNH, k_pages_PSKH, v_pages_PSKH, block_tables_BM, q_pos_BT, sinks_N,
                                         window)


def moe(x_TD, router_w_ED, router_b_E, experts, *, top_k, swiglu_limit, swiglu_alpha,
        impl: str = "reference"):
    _check(impl)
    return moe_reference.moe(x_TD, router_w_ED, router_b_E, experts, top_k=top_k,
                             swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha)
