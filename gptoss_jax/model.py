"""The gpt-oss transformer as pure functions over `Params` (see docs/model.md for the math).

Pre-norm residual blocks, each attention (GQA, q/k/v/o biases, YaRN RoPE, learned sinks, sliding
window on even layers) followed by a top-k MXFP4 mixture of experts. Layers run as one `lax.scan`
over (sliding, full) pairs, so each attention reads its own page pool with a static window; the
paged KV cache rides in the scan carry so XLA updates it in place (docs/engine.md, "Cache layout").
"""

import jax
import jax.numpy as jnp
from flax import struct

import pallas_kernels
from gptoss_jax import rope
from gptoss_jax.config import ModelConfig
from gptoss_jax.params import Params

FULL_WINDOW = 2**31 - 1
NULL_PAGE = 0  # write target of padded or already-cached tokens; never read at a visible position


@struct.dataclass
class PagedKVCache:
    """Two page pools: sliding layers (even) keep only their window's pages, full layers (odd) keep all.

    Position `p` of a sequence lives in page `table[p // page_size]`, slot `p % page_size`, of the
    pool of the layer's type."""
    k_sliding: jax.Array  # [Ls, Ps, S, K, H]
    v_sliding: jax.Array  # [Ls, Ps, S, K, H]
    k_full: jax.Array     # [Lf, Pf, S, K, H]
    v_full: jax.Array     # [Lf, Pf, S, K, H]

    @classmethod
    def zeros(cls, cfg: ModelConfig, num_pages_sliding: int, num_pages_full: int, page_size: int,
              dtype) -> "PagedKVCache":
        ls, lf = (cfg.num_layers + 1) // 2, cfg.num_layers // 2
        tail = (page_size, cfg.num_kv_heads, cfg.head_dim)
        s, f = (ls, num_pages_sliding) + tail, (lf, num_pages_full) + tail
        return cls(k_sliding=jnp.zeros(s, dtype), v_sliding=jnp.zeros(s, dtype),
                   k_full=jnp.zeros(f, dtype), v_full=jnp.zeros(f, dtype))

    @property
    def page_size(self) -> int:
        return self.k_sliding.shape[2]


@struct.dataclass
class PageTables:
    """Where one call's tokens read and write. `full_cached_B`: positions below it are already in shared
    (prefix-cached) full-layer pages, so their full-layer writes go to the null page."""
    sliding_BM: jax.Array  # int32 [B, M]
    full_BM: jax.Array     # int32 [B, M]
    full_cached_B: jax.Array  # int32 [B]


def _write_targets(table_BM: jax.Array, positions_BT: jax.Array, write_from_B: jax.Array, page_size: int):
    """(page, slot) `[B, T]` each new token's K/V goes to; padding and skipped tokens hit the null page."""
    M = table_BM.shape[1]
    col = positions_BT // page_size
    ok = (positions_BT >= write_from_B[:, None]) & (positions_BT >= 0) & (col < M)
    page = jnp.take_along_axis(table_BM, jnp.clip(col, 0, M - 1), axis=1)
    return jnp.where(ok, page, NULL_PAGE), jnp.maximum(positions_BT, 0) % page_size
def rms_norm(x: jax.Array, gain: jax.Array, eps: float, dtype) -> jax.Array:
    """Normalise and apply the gain in fp32, then cast (gpt-oss order; Llama casts first)."""
    t = x.astype(jnp.float32)
    t = t * jax.lax.rsqrt(jnp.mean(t * t, axis=-1, keepdims=True) + eps)
    return (t * gain.astype(jnp.float32)).astype(dtype)


def _linear(x: jax.Array, w_OI: jax.Array, b_O: jax.Array) -> jax.Array:
    """`x @ w.T + b`, accumulated and returned in fp32."""
    y = jnp.einsum("...i,oi->...o", x, w_OI, preferred_element_type=jnp.float32)
    return y + b_O.astype(jnp.float32)


def _attention_block(cfg: ModelConfig, lp, x_BTD, cos, sin, k_all, v_all, idx, table_BM, write_page_BT,
                     write_slot_BT, positions_BT, window: int, impl: str):
    """One attention layer: project, write the new K/V into layer `idx` of the pool, attend through the table."""
    B, T, _ = x_BTD.shape
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    dtype = k_all.dtype
    t = rms_norm(x_BTD, lp.attn_norm, cfg.rms_norm_eps, dtype)
    q = rope.apply(_linear(t, lp.q_w, lp.q_b).astype(dtype).reshape(B, T, N, H), cos, sin)
    k = rope.apply(_linear(t, lp.k_w, lp.k_b).astype(dtype).reshape(B, T, K, H), cos, sin)
    v = _linear(t, lp.v_w, lp.v_b).astype(dtype).reshape(B, T, K, H)
    k_all = k_all.at[idx, write_page_BT, write_slot_BT].set(k)
    v_all = v_all.at[idx, write_page_BT, write_slot_BT].set(v)
    o = pallas_kernels.attention(q, k_all[idx], v_all[idx], table_BM, positions_BT, lp.sinks, window, impl=impl)
    return _linear(o.reshape(B, T, N * H), lp.o_w, lp.o_b), k_all, v_all


def _moe_block(cfg: ModelConfig, lp, x_BTD, dtype, impl):
    B, T, D = x_BTD.shape
    t = rms_norm(x_BTD, lp.mlp_norm, cfg.rms_norm_eps, dtype).reshape(B * T, D)
    y = pallas_kernels.moe(t, lp.router_w, lp.router_b, lp.experts, top_k=cfg.experts_per_token,
                           swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha, impl=impl)
    return y.reshape(B, T, D)


def forward(params: Params, cache: PagedKVCache, tokens_BT: jax.Array, positions_BT: jax.Array,
            tables: PageTables, cfg: ModelConfig, impl: str = "reference") -> tuple[jax.Array, PagedKVCache]:
    """Run the layers on new tokens at `positions_BT` (-1 = padding), writing their K/V into `cache`.

    Returns the final-normed hidden states `[B, T, D]` (pass the rows you need to `unembed`) and the
    updated cache. Weights, the cache and matmul operands are in the parameters' dtype; the residual
    stream and every accumulation are fp32 (a bf16 residual drifts enough to flip router choices).
    """
    dtype = params.embed.dtype
    S = cache.page_size
    x = params.embed[tokens_BT].astype(jnp.float32)  # the residual stream stays fp32
    cos, sin = rope.cos_sin(cfg, jnp.maximum(positions_BT, 0), dtype)
    s_page, s_slot = _write_targets(tables.sliding_BM, positions_BT, jnp.zeros_like(tables.full_cached_B), S)
    f_page, f_slot = _write_targets(tables.full_BM, positions_BT, tables.full_cached_B, S)

    def layer(x, caches, lp, idx, sliding: bool):
        ks, vs, kf, vf = caches
        with jax.named_scope("sliding_attention" if sliding else "full_attention"):
            if sliding:
                a, ks, vs = _attention_block(cfg, lp, x, cos, sin, ks, vs, idx, tables.sliding_BM, s_page, s_slot,
                                             positions_BT, cfg.sliding_window, impl)
            else:
                a, kf, vf = _attention_block(cfg, lp, x, cos, sin, kf, vf, idx, tables.full_BM, f_page, f_slot,
                                             positions_BT, FULL_WINDOW, impl)
            x = x + a
        with jax.named_scope("moe"):
            x = x + _moe_block(cfg, lp, x, dtype, impl)
        return x, (ks, vs, kf, vf)

    def pair(carry, inputs):
        x, caches = carry
        lp_pair, i = inputs
        x, caches = layer(x, caches, jax.tree.map(lambda a: a[0], lp_pair), i, sliding=True)
        x, caches = layer(x, caches, jax.tree.map(lambda a: a[1], lp_pair), i, sliding=False)
        return (x, caches), None

    pairs = cfg.num_layers // 2
    caches = (cache.k_sliding, cache.v_sliding, cache.k_full, cache.v_full)
    with jax.named_scope("layers"):
        if pairs:
            stacked = jax.tree.map(lambda a: a[:2 * pairs].reshape(pairs, 2, *a.shape[1:]), params.layers)
            (x, caches), _ = jax.lax.scan(pair, (x, caches), (stacked, jnp.arange(pairs)))
        if cfg.num_layers % 2:  # an odd layer count ends on a sliding layer
            x, caches = layer(x, caches, jax.tree.map(lambda a: a[-1], params.layers), pairs, sliding=True)
    with jax.named_scope("final_norm"):
        x = rms_norm(x, params.final_norm, cfg.rms_norm_eps, dtype)
    return x, PagedKVCache(*caches)


def unembed(params: Params, x_BD: jax.Array) -> jax.Array:
    """Logits in fp32 for hidden states `[..., D]` (untied output matrix, no bias, no soft-cap)."""
    with jax.named_scope("unembed"):
        return jnp.einsum("...d,vd->...v", x_BD, params.unembed, preferred_element_type=jnp.float32)
