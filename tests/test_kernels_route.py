"""The fused decode MoE front end (`moe_route`, CPU interpret mode) against its reference on fresh random inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import expert_format, layer_index, moe_gemv, moe_route, moe_slots
from pallas_kernels.choice import CPU, H200, KernelConfig, choose
from pallas_kernels.params import Experts

EPS = 1e-5


def _inputs(rng, T, E, D, L):
    scale = np.geomspace(1e-2, 1e4, T)[:, None]  # rows whose largest |t| spans many f16 exponents
    x = rng.normal(size=(T, D)) * scale
    if T >= 3:
        x[1] = 0.0  # an all-zero row: t = +-0, logits = bias, factor 1
    gain = rng.normal(size=(L, D))
    router = rng.normal(size=(L, E, D)) * 0.05
    bias = rng.normal(size=(L, E))
    return (
        jnp.asarray(x, jnp.float32),
        jnp.asarray(gain, jnp.float32),
        jnp.asarray(router, jnp.bfloat16),
        jnp.asarray(bias, jnp.bfloat16),
    )


@pytest.mark.parametrize("T, E, D, L", [(1, 32, 2880, 3), (5, 12, 96, 2), (16, 128, 256, 2), (3, 3, 64, 1)])
def test_front_kernel_matches_reference(T, E, D, L):
    """Activation words and factors bit-exact; logits to f32 summation order."""
    x, gain, router, bias = _inputs(np.random.default_rng(T * E), T, E, D, L)
    layer = jnp.int32(L - 1)
    logits, words, xs = (
        np.asarray(a) for a in moe_route.front(x, gain, router, bias, layer, eps=EPS, dtype=jnp.bfloat16)
    )
    ref = moe_route.reference(x, gain, router, bias, layer, eps=EPS, dtype=jnp.bfloat16)
    np.testing.assert_allclose(logits, np.asarray(ref[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(words, np.asarray(ref[1]))
    np.testing.assert_array_equal(xs, np.asarray(ref[2]))
    if T >= 3:
        assert (words[1] & 0x7FFF7FFF == 0).all() and xs[1] == 1.0  # halves of +-0
        np.testing.assert_array_equal(logits[1], np.asarray(bias[L - 1], np.float32))


def _experts(rng, L, E, D, I):
    u8 = lambda *s: jnp.asarray(rng.integers(0, 256, s, dtype=np.uint8))
    sc = lambda *s: jnp.asarray(rng.integers(117, 129, s, dtype=np.uint8))
    return Experts(
        gate_up_blocks=u8(L, E, 2 * I, D // 32, 16),
        gate_up_scales=sc(L, E, 2 * I, D // 32),
        gate_up_bias=jnp.asarray(rng.normal(size=(L, E, 2 * I)), jnp.bfloat16),
        down_blocks=u8(L, E, D, I // 32, 16),
        down_scales=sc(L, E, D, I // 32),
        down_bias=jnp.asarray(rng.normal(size=(L, E, D)), jnp.bfloat16),
    )


@pytest.mark.parametrize("T", [1, 3])
def test_moe_block_takes_the_fused_kernels_and_matches_reference(monkeypatch, T):
    """`pallas_kernels.moe_block` at decode sizes of a bf16 model: the fused front and back ends run (spied), and
    the residual stream and its norm with the next gain (the next layer's, or the final one after the last layer)
    match the reference's norm + route + experts + residual + norm on the same stacked weights. The kernels take
    the layer as the layer scan gives it (`layer_index`: counter 0, layer 2i or 2i + 1), the reference its number."""
    rng = np.random.default_rng(7 + T)
    E, k, D, I, L = 8, 2, 96, 64, 2
    x, gain, router, bias = _inputs(rng, T, E, D, L)
    x = x / jnp.max(jnp.abs(x), axis=1, keepdims=True).clip(1e-6)  # residual-stream magnitudes
    ex = _experts(rng, L, E, D, I)
    gains = (jnp.asarray(rng.normal(size=(L, D)), jnp.float32), jnp.asarray(rng.normal(size=D), jnp.float32))
    calls = []
    for name in ("front", "back"):
        spy = getattr(moe_route, name)
        monkeypatch.setattr(moe_route, name, lambda *a, _spy=spy, _n=name, **kw: calls.append(_n) or _spy(*a, **kw))
    kw = dict(eps=EPS, dtype=jnp.bfloat16, top_k=k, swiglu_limit=7.0, swiglu_alpha=1.702)
    for layer in range(L):
        got_x, got_t = pallas_kernels.moe_block(
            x,
            gain,
            router,
            bias,
            expert_format.prepare_experts(ex),
            layer_index.LayerIndex(jnp.int32(layer // 2), 2, layer % 2),
            gains,
            kernels=KernelConfig(impl="pallas"),
            **kw,
        )
        ref_x, ref_t = pallas_kernels.moe_block(
            x, gain, router, bias, ex, jnp.int32(layer), gains, kernels=KernelConfig(impl="reference"), **kw
        )
        assert got_x.dtype == ref_x.dtype == jnp.float32 and got_t.dtype == ref_t.dtype == jnp.bfloat16
        # the MoE output alone: the residual rows of near-1 magnitude would hide its error
        a, b = np.asarray(got_x - x, np.float64), np.asarray(ref_x - x, np.float64)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2
        a, b = np.asarray(got_t, np.float64), np.asarray(ref_t, np.float64)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2
        # the gain is the one after this layer: the next layer's, then the final one
        want = pallas_kernels.rms_norm(got_x, gains[0][layer + 1] if layer + 1 < L else gains[1], EPS, jnp.bfloat16)
        np.testing.assert_allclose(np.asarray(got_t, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)
    assert calls == ["front", "back"] * L


def test_back_kernel_matches_reference():
    """`moe_route.back` on fresh rows (one all-zero residual row, the last layer's final gain): the residual row
    as XLA adds it (up to one bf16 rounding of the expert sum, whose order may differ), the normed row to the bf16
    rounding."""
    rng = np.random.default_rng(5)
    T, k, D, L = 3, 4, 2880, 3
    y = jnp.asarray(rng.normal(size=(T * k, D)) * 3, jnp.float32)
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32).at[1].set(0.0)
    gains = (jnp.asarray(rng.normal(size=(L, D)), jnp.float32), jnp.asarray(rng.normal(size=D), jnp.float32))
    for layer, gain in ((0, gains[0][1]), (L - 1, gains[1])):
        got_x, got_t = moe_route.back(y, x, gains, jnp.int32(layer), top_k=k, eps=EPS, dtype=jnp.bfloat16)
        want_x = x + moe_slots.combine(y, None, None, T, k, jnp.bfloat16).astype(jnp.float32)
        np.testing.assert_allclose(np.asarray(got_x), np.asarray(want_x), atol=2**-8 * float(jnp.abs(want_x - x).max()))
        want_t = pallas_kernels.rms_norm(want_x, gain, EPS, jnp.bfloat16)
        np.testing.assert_allclose(np.asarray(got_t, np.float32), np.asarray(want_t, np.float32), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device", [H200, CPU], ids=["hopper", "cpu"])
def test_fused_front_end_regime(device):
    """bf16 models, up to `moe_route_max_tokens` (8) tokens, and only while experts average <= 2 routed rows (the
    `gemv16` regime)."""

    def applies(T, k, E, dtype):
        return choose("moe", T, (2880, 2880, E, k), dtype, device, KernelConfig(impl="pallas")).kernel == "route"

    assert applies(1, 4, 32, jnp.bfloat16) and applies(8, 4, 32, jnp.bfloat16)
    assert not applies(9, 4, 128, jnp.bfloat16)
    assert not applies(1, 4, 32, jnp.float32)
    assert not applies(4, 4, 4, jnp.bfloat16)


def test_routed_gemvs_of_a_step_that_is_not_live_read_no_expert():
    """A step without tokens (`LayerIndex.live` 0): the gate/up programs route no pair (expert -1)
    and the down programs write zeros, whatever the experts hold (NaN biases here: a pair that ran would show)."""
    rng = np.random.default_rng(4)
    T, E, k, D, I, L = 3, 8, 2, 64, 64, 2
    ex = _experts(rng, L, E, D, I)
    ex = ex.replace(
        gate_up_bias=jnp.full_like(ex.gate_up_bias, jnp.nan), down_bias=jnp.full_like(ex.down_bias, jnp.nan)
    )
    flat = expert_format.flatten_layers(expert_format.prepare_experts(ex))
    words, xs = moe_gemv.half_pairs(jnp.asarray(rng.normal(size=(T, D)), jnp.bfloat16))
    logits = jnp.asarray(rng.normal(size=(T, E)), jnp.float32)
    cfg = choose("moe", T, (D, I, E, k), jnp.bfloat16, CPU, KernelConfig(impl="pallas")).kw["gemv"]
    kw = dict(top_k=k, swiglu_limit=7.0, swiglu_alpha=1.702, **cfg)
    for live in (False, True):
        layer = layer_index.LayerIndex(jnp.int32(0), 2, 1, live=jnp.asarray([live], jnp.int32))
        y = np.asarray(moe_gemv.run_routed(words, xs, logits, layer, flat, **kw))
        assert y.shape == (T * k, D)
        assert np.isnan(y).all() if live else not y.any()


@pytest.mark.parametrize("E", [8, 32, 128])  # a warp's lanes hold 8 logits of 8, 32 of 32, 4 x 32 of 128
def test_in_kernel_routing_matches_dispatched_pairs(E):
    """The `gemv16` kernels routing each pair from the logits give what they give on `lax.top_k`'s pairs,
    ties included (experts 2 and 5 share a logit: the lower id is the better, as in `lax.top_k`; in the last token
    expert 6's 0.0 beats expert 1's -0.0, as there)."""
    rng = np.random.default_rng(9)
    T, k, D, I, L = 4, 3, 64, 64, 2
    logits = rng.normal(size=(T, E)).astype(np.float32)
    logits[:, 5] = logits[:, 2] = logits.max(axis=1) + 1.0
    logits[-1] = -np.abs(logits[-1]) - 1.0
    logits[-1, [2, 5, 1, 6]] = [1.0, 1.0, -0.0, 0.0]
    logits = jnp.asarray(logits)
    kexp = expert_format.prepare_experts(_experts(rng, L, E, D, I))
    flat = expert_format.flatten_layers(kexp)
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.bfloat16)
    cfg = choose("moe", T, (D, I, E, k), jnp.bfloat16, CPU, KernelConfig(impl="pallas")).kw["gemv"]
    kw = dict(swiglu_limit=7.0, swiglu_alpha=1.702)
    vals, idx = jax.lax.top_k(logits, k)
    assert (np.asarray(idx)[:, :2] == [2, 5]).all() and np.asarray(idx)[-1, 2] == 6
    want = moe_gemv.experts(x, idx, jax.nn.softmax(vals, axis=-1), kexp, jnp.int32(1), **kw, **cfg)
    words, xs = moe_gemv.half_pairs(x)
    y = moe_gemv.run_routed(words, xs, logits, jnp.int32(1), flat, top_k=k, **kw, **cfg)
    got = moe_slots.combine(y, None, None, T, k, jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)
    assert (
        np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)).max()
        <= 2**-7 * np.abs(np.asarray(want, np.float32)).max()
    )
