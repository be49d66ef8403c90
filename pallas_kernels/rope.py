"""YaRN rotary embedding in gpt-oss's half-split (NeoX) layout, without range truncation.

Here, below the kernels, because the decode attention kernel fuses `apply`. `cfg` is a
`gptoss_jax.config.ModelConfig` (only its RoPE fields are read).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np


def inv_freq(cfg) -> np.ndarray:
    """Per-pair inverse frequencies `[head_dim/2]` (float64), NTK-by-parts blend of the original
    and the position-interpolated frequencies. `truncate=False` (gpt-oss) keeps the correction
    range unrounded; rounding it changes pairs 9-17 by up to 76%."""
    d_half = cfg.head_dim // 2
    freq = cfg.rope_theta ** (np.arange(d_half, dtype=np.float64) * 2 / cfg.head_dim)
    if cfg.rope_factor <= 1.0:
        return 1.0 / freq

    def correction_dim(beta: float) -> float:
        return d_half * math.log(cfg.rope_original_max_pos / (beta * 2 * math.pi)) / math.log(cfg.rope_theta)

    low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0.0), min(high, d_half - 1.0)
    if high == low:
        high += 1e-3
    ramp = np.clip((np.arange(d_half) - low) / (high - low), 0.0, 1.0)
    keep_original = 1.0 - ramp
    return (1.0 / (cfg.rope_factor * freq)) * (1.0 - keep_original) + (1.0 / freq) * keep_original


def cos_sin(cfg, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """cos and sin `[*positions.shape, head_dim/2]`, each already scaled by the YaRN concentration."""
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq(cfg), jnp.float32)
    c = jnp.float32(cfg.rope_concentration)
    return (jnp.cos(angle) * c).astype(dtype), (jnp.sin(angle) * c).astype(dtype)


def apply(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate `x[..., T, heads, head_dim]` with `cos`/`sin` `[..., T, head_dim/2]`: first half pairs
    with second half."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    c, s = cos[..., None, :], sin[..., None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
