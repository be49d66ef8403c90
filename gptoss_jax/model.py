"""The gpt-oss transformer as pure functions over `Params` (see docs/model.md for the math).

Pre-norm residual blocks, each attention (GQA, q/k/v/o biases, YaRN RoPE, learned sinks, sliding
window on even layers) followed by a top-k MXFP4 mixture of experts. All layers run in one
`lax.scan`; the KV cache rides in the scan carry so XLA updates it in place.
"""

import jax
import jax.numpy as jnp
from flax import struct

import pallas_kernels
from gptoss_jax import rope
from gptoss_jax.config import ModelConfig
from gptoss_jax.params import Params

FULL_WINDOW = jnp.iinfo(jnp.int32).max


@struct.dataclass
class KVCache:
    """Contiguous per-sequence cache: slot `j` of row `b` holds the key/value at position `j`."""
    k: jax.Array  # [L, B, S, Nkv, H]
    v: jax.Array  # [L, B, S, Nkv, H]

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, max_len: int, dtype) -> "KVCache":
        shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def rms_norm(x: jax.Array, gain: jax.Array, eps: float, dtype) -> jax.Array:
    """Normalise and apply the gain in fp32, then cast (gpt-oss order; Llama casts first)."""
    t = x.astype(jnp.float32)
    t = t * jax.lax.rsqrt(jnp.mean(t * t, axis=-1, keepdims=True) + eps)
    return (t * gain.astype(jnp.float32)).astype(dtype)


def _linear(x: jax.Array, w_OI: jax.Array, b_O: jax.Array) -> jax.Array:
    """`x @ w.T + b`, accumulated and returned in fp32."""
    y = jnp.einsum("...i,oi->...o", x, w_OI, preferred_element_type=jnp.float32)
    return y + b_O.astype(jnp.float32)


def _attention_block(cfg: ModelConfig, lp, x_BTD, cos, sin, k_cache, v_cache, positions_BT, window,
                     impl):
    B, T, _ = x_BTD.shape
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    dtype = k_cache.dtype
    t = rms_norm(x_BTD, lp.attn_norm, cfg.rms_norm_eps, dtype)
    q = rope.apply(_linear(t, lp.q_w, lp.q_b).astype(dtype).reshape(B, T, N, H), cos, sin)
    k = rope.apply(_linear(t, lp.k_w, lp.k_b).astype(dtype).reshape(B, T, K, H), cos, sin)
    v = _linear(t, lp.v_w, lp.v_b).astype(dtype).reshape(B, T, K, H)
    rows = jnp.arange(B)[:, None]
    k_cache = k_cache.at[rows, positions_BT].set(k.astype(k_cache.dtype))
    v_cache = v_cache.at[rows, positions_BT].set(v.astype(v_cache.dtype))
    o = pallas_kernels.attention(q, k_cache, v_cache, lp.sinks, positions_BT, window, impl=impl)
    return _linear(o.reshape(B, T, N * H), lp.o_w, lp.o_b), k_cache, v_cache


def _moe_block(cfg: ModelConfig, lp, x_BTD, dtype, impl):
    B, T, D = x_BTD.shape
    t = rms_norm(x_BTD, lp.mlp_norm, cfg.rms_norm_eps, dtype).reshape(B * T, D)
    y = pallas_kernels.moe(t, lp.router_w, lp.router_b, lp.experts, top_k=cfg.experts_per_token,
                           swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha, impl=impl)
    return y.reshape(B, T, D)


def forward(params: Params, cache: KVCache, tokens_BT: jax.Array, positions_BT: jax.Array,
            cfg: ModelConfig, impl: str = "reference") -> tuple[jax.Array, KVCache]:
    """Run the layers on new tokens, writing their K/V into `cache` at `positions_BT`.

    Returns the final-normed hidden states `[B, T, D]` (pass the rows you need to `unembed`) and the
    updated cache. Weights, the cache and matmul operands are in the parameters' dtype; the residual
    stream and every accumulation are fp32 (a bf16 residual drifts enough to flip router choices).
    """
    dtype = params.embed.dtype
    x = params.embed[tokens_BT].astype(jnp.float32)  # the residual stream stays fp32
    cos, sin = rope.cos_sin(cfg, positions_BT, dtype)
    windows = jnp.asarray([cfg.sliding_window if cfg.is_sliding(l) else FULL_WINDOW
                           for l in range(cfg.num_layers)], jnp.int32)

    def layer(carry, inputs):
        x, k_all, v_all = carry
        lp, idx, window = inputs
        with jax.named_scope("attention"):
            a, k_l, v_l = _attention_block(cfg, lp, x, cos, sin, k_all[idx], v_all[idx], positions_BT,
                                           window, impl)
            x = x + a
        with jax.named_scope("moe"):
            x = x + _moe_block(cfg, lp, x, dtype, impl)
        k_all = jax.lax.dynamic_update_index_in_dim(k_all, k_l, idx, 0)
        v_all = jax.lax.dynamic_update_index_in_dim(v_all, v_l, idx, 0)
        return (x, k_all, v_all), None

    with jax.named_scope("layers"):
        (x, k, v), _ = jax.lax.scan(layer, (x, cache.k, cache.v),
                                    (params.layers, jnp.arange(cfg.num_layers), windows))
    with jax.named_scope("final_norm"):
        x = rms_norm(x, params.final_norm, cfg.rms_norm_eps, dtype)
    return x, KVCache(k=k, v=v)


def unembed(params: Params, x_BD: jax.Array) -> jax.Array:
    """Logits in fp32 for hidden states `[..., D]` (untied output matrix, no bias, no soft-cap)."""
    with jax.named_scope("unembed"):
        return jnp.einsum("...d,vd->...v", x_BD, params.unembed, preferred_element_type=jnp.float32)
