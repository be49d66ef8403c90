"""FP8 (e4m3) KV cache entries: each key or value vector of one (token, KV head) is stored as `head_dim` float8_e4m3fn
values and one fp32 scale, value = fp8 * scale, with scale = max|x| / 448 (e4m3's largest finite value).

Why one scale per (token, head): it needs no calibration and never clips (each vector fills e4m3's range exactly),
and it is written with the token, so a page never has to be re-quantized as it fills. Per KV head or per page scales
would save the scale's 4 bytes per 64 (6% of an fp8 entry) but either clip outliers or need the page's whole
content first; docs/BENCHMARKS.md (issue 33) measures the error of each choice against the bf16 cache.

Where the scales live: a pool `[P, S, K, H]` keeps its scales as `[P, K, S]`, so that the S scales one KV head's page
holds are contiguous (64 bytes for 16 slots). Laid out `[P, S, K]`, the scale of one (slot, head) is 4 bytes at a stride
of K * 4 bytes, and the kernels' per-key loads then fetch a 32-byte sector per key, as many sectors as the key's 64
fp8 values (docs/kernels.md).

Where the values live: an FP8 value pool is transposed within each page, `[P, K, H, S]` (keys stay `[P, S, K, H]`).
In the attention dot `w V`, V is the B operand, and each thread needs consecutive *keys* of one head-dim column: bf16
gets them with `ldmatrix.trans`, but Hopper has no 8-bit `ldmatrix.trans`, so from `[P, S, K, H]` Triton reads every
e4m3 value with its own byte load. With the keys of a (page, head, dim) contiguous, a block of V loads as `[H, keys]`,
as K loads, and its dot takes it as K's does (docs/kernels.md, "Attention over an FP8 KV cache").
"""

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
DTYPES = {"auto": None, "fp8": FP8, "fp8_e4m3": FP8}  # `kv_cache_dtype` (vLLM's names) -> pool dtype; None: the model's


def is_quantized(dtype) -> bool:
    return jnp.dtype(dtype) == jnp.dtype(FP8)


def value_bytes(dtype, head_dim: int) -> float:
    """Bytes one cached value takes in a pool of `dtype`, its share of the vector's scale included."""
    return jnp.dtype(dtype).itemsize + (4 / head_dim if is_quantized(dtype) else 0)


def scale_of(amax):
    """The scale of a vector whose largest magnitude is `amax` (f32): an all-zero vector gets 1."""
    return jnp.where(amax > 0, amax / FP8_MAX, 1.0)


def quantize(x_H: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`[..., H]` -> (float8_e4m3fn `[..., H]`, fp32 scale `[...]`); `dequantize` inverts it up to e4m3 rounding."""
    x = x_H.astype(jnp.float32)
    scale = scale_of(jnp.max(jnp.abs(x), axis=-1))
    return (x / scale[..., None]).astype(FP8), scale


def scales_PKS(scale_PSK: jax.Array) -> jax.Array:
    """Scales `[..., P, S, K]` (as `quantize` returns them for a pool `[..., P, S, K, H]`) in the pools' layout
    `[..., P, K, S]`."""
    return jnp.swapaxes(scale_PSK, -1, -2)


def values_PKHS(v_PSKH: jax.Array) -> jax.Array:
    """Values `[..., P, S, K, H]` (as `quantize` returns them for a pool's pages) in an FP8 value pool's layout
    `[..., P, K, H, S]`."""
    return jnp.moveaxis(v_PSKH, -3, -1)


def values_PSKH(v_PKHS: jax.Array) -> jax.Array:
    """An FP8 value pool `[..., P, K, H, S]` in the key pools' layout `[..., P, S, K, H]`."""
    return jnp.moveaxis(v_PKHS, -1, -3)


def set_values(v_PKHS: jax.Array, at: tuple, v_KH: jax.Array) -> jax.Array:
    """`v_PKHS` with the values `[..., K, H]` written at (page, slot) `at` (index arrays `[...]`; pages past the
    pool's end are not written)."""
    page, slot = at
    return v_PKHS.at[page, :, :, slot].set(v_KH, mode="drop")


def set_scales(scale_PKS: jax.Array, at: tuple, scale: jax.Array) -> jax.Array:
    """`scale_PKS` with the scales `[..., K]` of the vectors written at (page, slot) `at` (index arrays `[...]`; pages
    past the pool's end are not written)."""
    page, slot = at
    return scale_PKS.at[page[..., None], jnp.arange(scale_PKS.shape[1]), slot[..., None]].set(scale, mode="drop")


def dequantize(q_H: jax.Array, scale: jax.Array | None, dtype=jnp.float32) -> jax.Array:
    """The stored values in `dtype` (a pool without scales is returned as it is, cast)."""
    if scale is None:
        return q_H.astype(dtype)
    return (q_H.astype(jnp.float32) * scale[..., None]).astype(dtype)


# ---- inside the attention kernels ------------------------------------------------------------------------------------
# Stored e4m3 values convert to f16 in one instruction on Hopper (two per `cvt`), to bf16 only through f32; so with
# an FP8 pool the kernels' dots take f16 operands (queries cast once per program; e4m3 values are exact in f16).


def dot_dtype(quantized: bool, dtype):
    """The operand dtype of the attention dots: f16 over an FP8 pool in a half-precision model, else the model's (an
    fp32 model keeps fp32 dots: it is there for exactness, not speed)."""
    return jnp.float16 if quantized and jnp.dtype(dtype) != jnp.dtype(jnp.float32) else dtype


def value_weights(p, v_scale, dtype=jnp.float16):
    """Probabilities `p` `[rows, keys]` times each key's value scale, as dot operands of `dtype` (`dot_dtype`):
    normalized by the block's largest scale (returned, to multiply the dot's f32 result by) so that small scales
    cannot underflow f16."""
    top = jnp.maximum(jnp.max(v_scale), 1e-30)
    return (p * (v_scale / top)[None, :]).astype(dtype), top


def value_index(pages, kh, K: int, H: int, S: int):
    """Where the values of KV head `kh`'s slots in `pages` sit in an FP8 value pool's flat `[P * K * H * S]`, as a
    `[H, len(pages) * S]` tile: a head-dim row per row, keys in order along it, each page's S contiguous."""
    at = ((pages[None, :, None] * K + kh) * H + jnp.arange(H)[:, None, None]) * S + jnp.arange(S)[None, None, :]
    return at.reshape(H, pages.shape[0] * S)


def value_mask(first_page, n_keys: int, S: int, lo, hi):
    """Which keys an FP8 value load reads, `[n_keys]` from page `first_page` on: every slot of a page holding a key
    of `[lo, hi)`. A mask per key would change within a page's S contiguous bytes, and Triton then loads them one by
    one; the slots a page adds weigh 0 and hold finite values (a pool holds zeros and what `quantize` wrote)."""
    page = first_page + jax.lax.div(jnp.arange(n_keys), S)  # (`//` lowers to ops Triton cannot see through)
    return (page >= lo // S) & (page * S < hi)


def flat_pools(k_pages_PSKH, v_pages, k_scale_PKS, v_scale_PKS) -> list:
    """The attention kernels' pool operands: keys `[P * S, K, H]`; values as keys, or an FP8 pool's `[P * K * H * S]`
    (`value_index`); an FP8 pool's scales flat `[P * K * S]` (`scale_index`)."""
    P, S, K, H = k_pages_PSKH.shape
    if k_scale_PKS is None:
        return [a.reshape(P * S, K, H) for a in (k_pages_PSKH, v_pages)]
    return [k_pages_PSKH.reshape(P * S, K, H), *(a.reshape(-1) for a in (v_pages, k_scale_PKS, v_scale_PKS))]


def scale_index(pages, kh, K: int, S: int):
    """Where the scales of KV head `kh`'s slots in `pages` sit in a pool's flat `[P * K * S]` scales, in key order:
    `[len(pages) * S]`, each page's S contiguous."""
    return ((pages[:, None] * K + kh) * S + jnp.arange(S)[None, :]).reshape(pages.shape[0] * S)
