"""MXFP4 (OCP microscaling FP4) as stored in the gpt-oss checkpoints.

A weight `[..., out, in]` is stored as `blocks[..., out, in/32, 16]` (uint8, two E2M1 codes per byte,
low nibble = even element) and `scales[..., out, in/32]` (uint8, E8M0 with bias 127). The layout
matches the Hugging Face and OpenAI safetensors; GGUF and Metal files use other packings.
"""

import jax.numpy as jnp
import numpy as np

BLOCK = 32
SCALE_BIAS = 127
# E2M1 value of each 4-bit code; bit 3 is the sign.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(blocks: jnp.ndarray, scales: jnp.ndarray, dtype=jnp.bfloat16) -> jnp.ndarray:
    """`[..., G, 16]` uint8 codes and `[..., G]` uint8 scales -> `[..., G*32]` values in `dtype`."""
    lut = jnp.asarray(FP4_VALUES, jnp.float32)
    lo = lut[blocks & 0x0F]
    hi = lut[blocks >> 4]
    vals = jnp.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], BLOCK)
    scale = jnp.ldexp(jnp.float32(1.0), scales.astype(jnp.int32) - SCALE_BIAS)
    out = vals * scale[..., None]
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK).astype(dtype)


def dequantize_np(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """NumPy twin of `dequantize` (float32), for tools and tests."""
    lut = np.asarray(FP4_VALUES, np.float32)
    vals = np.stack([lut[blocks & 0x0F], lut[blocks >> 4]], axis=-1).reshape(*blocks.shape[:-1], BLOCK)
    out = vals * np.ldexp(np.float32(1.0), scales.astype(np.int32) - SCALE_BIAS)[..., None]
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK)
