"""RMSNorm in gpt-oss's order; shared by the model and the fused decode kernels that start with it."""

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, gain: jax.Array, eps: float, dtype) -> jax.Array:
    """Normalise and apply the gain in fp32, then cast (gpt-oss order; Llama casts first)."""
    t = x.astype(jnp.float32)
    t = t * jax.lax.rsqrt(jnp.mean(t * t, axis=-1, keepdims=True) + eps)
    return (t * gain.astype(jnp.float32)).astype(dtype)
