"""MXFP4 mixture-of-experts for prefill / large batches (hundreds to tens of thousands of tokens).

The "mma" kernel family of `moe_decode` (see its docstring for the backend choice and the
re-encoded MXFP4 words), run with large row tiles: the (token, expert) pairs are sorted by
expert and cut into `block_m`-row tiles (one expert per tile, the last tile of each expert padded
by masking), and each program computes a `[block_m, block_n]` output tile with tensor-core `dot`s
(Triton lowers them to Hopper wgmma) on weights decoded to bf16 once per K step and reused across
the `block_m` rows.  Programs of the same expert and feature tile are adjacent in the grid's fast
axis, so the expert's weights are served from L2 to its row tiles.  Empty experts cost nothing.
"""

import jax.numpy as jnp

from pallas_kernels import moe_decode
from pallas_kernels.moe_decode import KernelExperts, prepare_experts  # noqa: F401  (re-export)


def prefill_config(T: int, k: int, E: int) -> dict:
    """Block sizes for the grouped-GEMM regime (best of the sweep on the H200, 2026-11-21:
    241 TFLOP/s at 20b and 211 TFLOP/s at 120b for 8,192 tokens)."""
    return dict(kernel="mma", block_m=128, block_n=64, block_k=128, block_n_down=64, num_warps=4,
                num_stages=3, swap=True)


def moe(x_TD, router_w_ED, router_b_E, kexp: KernelExperts, *, top_k, swiglu_limit, swiglu_alpha,
        layer=None, interpret=None, **config):
    """Drop-in for `moe_reference.moe` (many tokens), taking `prepare_experts(experts)`: the decode entry
    point with the grouped-GEMM block configuration."""
    cfg = prefill_config(x_TD.shape[0], top_k, router_w_ED.shape[0]) | config
    return moe_decode.moe(x_TD, router_w_ED, router_b_E, kexp, top_k=top_k, swiglu_limit=swiglu_limit,
                          swiglu_alpha=swiglu_alpha, layer=layer, interpret=interpret, **cfg)


DECODE_ROWS = 64  # up to this many tokens the decode configuration, beyond it the grouped-GEMM one


def auto_config(T: int, k: int, E: int, dtype) -> dict:
    """The decode or prefill configuration for a (static) token count and the model's dtype."""
    if T <= DECODE_ROWS:
        return moe_decode.decode_config(T, k, E, half=dtype != jnp.float32)
    return prefill_config(T, k, E)


def moe_auto(x_TD, router_w_ED, router_b_E, kexp: KernelExperts, *, top_k, swiglu_limit,
             swiglu_alpha, layer=None, interpret=None):
    """`moe_decode.moe` with `auto_config`."""
    cfg = auto_config(x_TD.shape[0], top_k, router_w_ED.shape[0], x_TD.dtype)
    return moe_decode.moe(x_TD, router_w_ED, router_b_E, kexp, top_k=top_k, swiglu_limit=swiglu_limit,
                          swiglu_alpha=swiglu_alpha, layer=layer, interpret=interpret, **cfg)
