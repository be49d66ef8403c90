"""Pins the gpt-oss details that implementations most often get wrong (model_math.md section 8)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gptoss_jax.config import preset
from pallas_kernels import attention_reference, moe_reference, mxfp4, rope
from pallas_kernels.params import Experts


def test_mxfp4_nibble_order_and_scale_bias():
    # byte 0x71: low nibble 1 (+0.5) is element 0, high nibble 7 (+6.0) is element 1.
    blocks = np.zeros((1, 16), np.uint8)
    blocks[0, 0] = 0x71
    blocks[0, 1] = 0xA9  # element 2 = code 9 (-0.5), element 3 = code 10 (-1.0)
    scales = np.array([127 + 3], np.uint8)  # 2^(130 - 127) = 8
    w = np.asarray(mxfp4.dequantize(jnp.asarray(blocks), jnp.asarray(scales), jnp.float32))
    assert w.shape == (32,)
    np.testing.assert_array_equal(w[:4], [4.0, 48.0, -4.0, -8.0])
    assert np.all(w[4:] == 0)
    np.testing.assert_array_equal(mxfp4.dequantize_np(blocks, scales), w)
    assert mxfp4.dequantize(jnp.asarray(blocks), jnp.asarray(np.array([127], np.uint8)), jnp.float32)[1] == 6.0


def test_mxfp4_full_lut():
    codes = np.arange(16, dtype=np.uint8)
    blocks = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)
    blocks = np.concatenate([blocks, np.zeros(8, np.uint8)])[None]
    w = mxfp4.dequantize_np(blocks, np.array([127], np.uint8))[:16]
    np.testing.assert_array_equal(w, [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def test_yarn_inv_freq_values_without_truncation():
    f = rope.inv_freq(preset("gpt-oss-20b"))
    expected = {
        0: 1.0,
        8: 5.081327e-02,
        9: 3.170570e-02,
        12: 6.794959e-03,
        15: 1.052602e-03,
        17: 1.293187e-04,
        18: 3.830881e-05,
        31: 3.023511e-07,
    }
    for i, v in expected.items():
        assert f[i] == pytest.approx(v, rel=1e-6), i
    truncated = rope.inv_freq(preset("gpt-oss-20b").__class__(**{**vars(preset("gpt-oss-20b")), "rope_truncate": True}))
    assert truncated[17] == pytest.approx(2.279478e-04, rel=1e-6)


def test_yarn_concentration_on_cos_and_sin():
    cfg = preset("gpt-oss-20b")
    assert cfg.rope_concentration == pytest.approx(0.1 * math.log(32) + 1)
    cos, sin = rope.cos_sin(cfg, jnp.arange(5), jnp.float32)
    assert np.allclose(np.asarray(cos) ** 2 + np.asarray(sin) ** 2, cfg.rope_concentration**2, rtol=1e-5)


def test_rope_is_half_split():
    x = jnp.arange(8, dtype=jnp.float32).reshape(1, 1, 8)  # T=1, heads=1, head_dim=8
    cos, sin = jnp.zeros((1, 4)), jnp.ones((1, 4))  # 90 degree rotation
    out = np.asarray(rope.apply(x, cos, sin))[0, 0]
    np.testing.assert_array_equal(out, [-4, -5, -6, -7, 0, 1, 2, 3])  # pairs (i, i + d/2)


def _attn_inputs(T, N=2, K=1, H=8, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    return (
        jax.random.normal(k[0], (1, T, N, H)),
        jax.random.normal(k[1], (1, T, K, H)),
        jax.random.normal(k[2], (1, T, K, H)),
    )


def _paged(q, k, v, sinks, pos, window, page_size=4):
    """The reference over a contiguous `[1, T, K, H]` cache laid out in shuffled pages (page 0 null)."""
    T = k.shape[1]
    n = -(-T // page_size)
    pad = ((0, 0), (0, n * page_size - T), (0, 0), (0, 0))
    order = np.random.default_rng(T).permutation(n) + 1  # page of block i

    def pages(x):
        blocks = jnp.pad(x, pad)[0].reshape(n, page_size, *x.shape[2:])
        return jnp.zeros((n + 1, *blocks.shape[1:]), x.dtype).at[order].set(blocks)

    return attention_reference.attention(q, pages(k), pages(v), jnp.asarray(order[None], jnp.int32), pos, sinks, window)


def test_window_boundary_128_keys_including_self():
    T, W = 300, 128
    q, k, v = _attn_inputs(T)
    sinks = jnp.zeros(2)
    pos = jnp.arange(T)[None]
    base = _paged(q, k, v, sinks, pos, W)
    i = 290
    for j, seen in ((i - 127, True), (i - 128, False)):
        v2 = v.at[0, j].add(100.0)
        out = _paged(q, k, v2, sinks, pos, W)
        changed = not np.allclose(out[0, i], base[0, i])
        assert changed == seen, (j, seen)


def test_sinks_enter_denominator_only():
    q, k, v = _attn_inputs(4)
    pos = jnp.arange(4)[None]
    big = _paged(q, k, v, jnp.full(2, 30.0), pos, 128)
    assert float(jnp.abs(big).max()) < 1e-6  # a dominant sink takes almost all the mass, adds no value
    # one visible key (position 0): out = v0 * e^z / (e^z + e^s)
    out = _paged(q[:, :1], k, v, jnp.full(2, 0.7), pos[:, :1], 128)
    z = float(jnp.dot(q[0, 0, 0], k[0, 0, 0])) / math.sqrt(8)
    expect = np.asarray(v[0, 0, 0]) * math.exp(z) / (math.exp(z) + math.exp(0.7))
    np.testing.assert_allclose(np.asarray(out[0, 0, 0]), expect, rtol=1e-5)


def test_router_softmax_over_top_k_only():
    x = jax.random.normal(jax.random.PRNGKey(1), (5, 16))
    w = jax.random.normal(jax.random.PRNGKey(2), (8, 16))
    b = jax.random.normal(jax.random.PRNGKey(3), (8,))
    idx, weights, logits = moe_reference.route(x, w, b, 3)
    logits = np.asarray(logits)
    top = np.argsort(-logits, axis=-1)[:, :3]
    np.testing.assert_array_equal(np.asarray(idx), top)
    sel = np.take_along_axis(logits, top, -1)
    expect = np.exp(sel - sel.max(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(weights), expect / expect.sum(-1, keepdims=True), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)


def _experts(E, D, I, seed, zero_weights=False):
    rng = np.random.default_rng(seed)
    gu_b = rng.integers(0, 256, (E, 2 * I, D // 32, 16), dtype=np.uint8)
    dn_b = rng.integers(0, 256, (E, D, I // 32, 16), dtype=np.uint8)
    if zero_weights:
        gu_b[:], dn_b[:] = 0, 0
    return Experts(
        gate_up_blocks=jnp.asarray(gu_b),
        gate_up_scales=jnp.full((E, 2 * I, D // 32), 124, jnp.uint8),
        gate_up_bias=jnp.asarray(rng.standard_normal((E, 2 * I)), jnp.float32),
        down_blocks=jnp.asarray(dn_b),
        down_scales=jnp.full((E, D, I // 32), 124, jnp.uint8),
        down_bias=jnp.asarray(rng.standard_normal((E, D)), jnp.float32),
    )


def test_expert_bias_inside_weighted_sum():
    E, D, I, k = 4, 32, 32, 2
    ex = _experts(E, D, I, 0, zero_weights=True)
    x = jax.random.normal(jax.random.PRNGKey(0), (3, D))
    rw, rb = jax.random.normal(jax.random.PRNGKey(1), (E, D)), jnp.zeros(E)
    y = moe_reference.moe(x, rw, rb, ex, top_k=k, swiglu_limit=7.0, swiglu_alpha=1.702)
    idx, w, _ = moe_reference.route(x, rw, rb, k)
    expect = jnp.einsum("tk,tkd->td", w, ex.down_bias[idx])
    np.testing.assert_allclose(np.asarray(y), np.asarray(expect), rtol=1e-5, atol=1e-6)


def test_swiglu_interleaved_asymmetric_clamp_plus_one():
    z = jnp.asarray([[10.0, 10.0, -10.0, -10.0, 1.0, 0.5]])  # (gate, up) pairs
    out = np.asarray(moe_reference.swiglu(z, 7.0, 1.702))[0]
    sig = lambda t: 1 / (1 + math.exp(-t))
    expect = [7 * sig(1.702 * 7) * 8, -10 * sig(-17.02) * (-6), 1 * sig(1.702) * 1.5]
    np.testing.assert_allclose(out, expect, rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 2, 3, 9])
def test_moe_gathered_and_dense_paths_agree(tokens):
    E, D, I, k = 8, 64, 32, 2
    ex = _experts(E, D, I, tokens)
    x = jax.random.normal(jax.random.PRNGKey(tokens), (tokens, D))
    rw = jax.random.normal(jax.random.PRNGKey(7), (E, D))
    rb = jax.random.normal(jax.random.PRNGKey(8), (E,))
    y = moe_reference.moe(x, rw, rb, ex, top_k=k, swiglu_limit=7.0, swiglu_alpha=1.702)
    # an explicit per-token loop over its chosen experts, in numpy
    idx, w, _ = moe_reference.route(x, rw, rb, k)
    xs, ref = np.asarray(x), np.zeros((tokens, D))
    for t in range(tokens):
        for j in range(k):
            e = int(idx[t, j])
            W1 = mxfp4.dequantize_np(np.asarray(ex.gate_up_blocks[e]), np.asarray(ex.gate_up_scales[e]))
            W2 = mxfp4.dequantize_np(np.asarray(ex.down_blocks[e]), np.asarray(ex.down_scales[e]))
            z = W1 @ xs[t] + np.asarray(ex.gate_up_bias[e])
            g, u = np.minimum(z[0::2], 7), np.clip(z[1::2], -7, 7)
            a = g / (1 + np.exp(-1.702 * g)) * (u + 1)
            ref[t] += float(w[t, j]) * (W2 @ a + np.asarray(ex.down_bias[e]))
    np.testing.assert_allclose(np.asarray(y), ref, rtol=2e-4, atol=2e-4)
