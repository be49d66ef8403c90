"""The fused decode MoE front end (`moe_route`, CPU interpret mode) against its reference on fresh random inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import expert_format, moe_gemv, moe_route, moe_slots
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
    match the reference's norm + route + experts + residual + norm on the same stacked weights."""
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
            jnp.int32(layer),
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


def test_in_kernel_routing_matches_dispatched_pairs():
    """The `gemv16` kernels routing each pair from the logits give what they give on `lax.top_k`'s pairs,
    ties included (experts 2 and 5 share a logit: the lower id is the better, as in `lax.top_k`)."""
    rng = np.random.default_rng(9)
    T, E, k, D, I, L = 4, 8, 3, 64, 64, 2
    logits = rng.normal(size=(T, E)).astype(np.float32)
    logits[:, 5] = logits[:, 2] = logits.max(axis=1) + 1.0
    logits = jnp.asarray(logits)
    kexp = expert_format.prepare_experts(_experts(rng, L, E, D, I))
    flat = expert_format.flatten_layers(kexp)
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.bfloat16)
    cfg = choose("moe", T, (D, I, E, k), jnp.bfloat16, CPU, KernelConfig(impl="pallas")).kw["gemv"]
    kw = dict(swiglu_limit=7.0, swiglu_alpha=1.702)
    vals, idx = jax.lax.top_k(logits, k)
    assert (np.asarray(idx)[:, :2] == [2, 5]).all()
    dispatched = {key: v for key, v in cfg.items() if not key.startswith("l2_")}  # the routed launch's own settings
    want = moe_gemv.experts(x, idx, jax.nn.softmax(vals, axis=-1), kexp, jnp.int32(1), **kw, **dispatched)
    words, xs = moe_gemv.half_pairs(x)
    y = moe_gemv.run_routed(words, xs, logits, jnp.int32(1), flat, top_k=k, **kw, **cfg)
    got = moe_slots.combine(y, None, None, T, k, jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)
    assert (
        np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)).max()
        <= 2**-7 * np.abs(np.asarray(want, np.float32)).max()
    )


def _routed_inputs(rng, T, E, k, D, I, L=2):
    """Layer L - 1 of random experts (flat `[L * E]`), bf16 tokens as `half_pairs`, logits, and the `gemv16` launch
    the choice gives at T tokens, which has no L2 programs unless configured (here without its L2 settings)."""
    kexp = expert_format.prepare_experts(_experts(rng, L, E, D, I))
    words, xs = moe_gemv.half_pairs(jnp.asarray(rng.normal(size=(T, D)), jnp.bfloat16))
    logits = jnp.asarray(rng.normal(size=(T, E)), jnp.float32)
    cfg = choose("moe", T, (D, I, E, k), jnp.bfloat16, CPU, KernelConfig(impl="pallas")).kw["gemv"]
    assert cfg.pop("l2_programs") == 0 and cfg.pop("l2_loads") == KernelConfig().moe_down_l2_loads
    kw = dict(top_k=k, swiglu_limit=7.0, swiglu_alpha=1.702, **cfg)
    return (words, xs, logits, jnp.int32(L - 1), expert_format.flatten_layers(kexp)), kw


def _pair_experts(logits, k, E, layer):
    """The flat expert of each (token, k-th best) pair, by `lax.top_k`."""
    return np.asarray(jax.lax.top_k(logits, k)[1]).reshape(-1) + layer * E


# (T, E, k, D, I, programs, loads): 3 programs a pair, 2 iterations of 2 loads, 23 of the L2 row's 32 programs idle;
# 2 tokens, 25 programs a pair of 3 rows each (the last ones past D: they read nothing), 25 rows of L2 programs
@pytest.mark.parametrize("T, E, k, D, I, programs, loads", [(1, 8, 3, 96, 512, 10, 2), (2, 4, 2, 64, 64, 100, 4)])
def test_down_l2_programs_leave_the_outputs_bit_identical(T, E, k, D, I, programs, loads):
    """The L2 programs added to the gate/up launch change no output bit (bf16 tokens, packed u32 words and u8
    scales), and each stores the maxima of the words and the scales of its share: rows [c share, (c + 1) share) of
    its pair's expert, share = ceil(D / programs per pair)."""
    args, kw = _routed_inputs(np.random.default_rng(T * D), T, E, k, D, I)
    y0, none = moe_gemv.routed(*args, **kw)
    y1, maxima = moe_gemv.routed(*args, **kw, l2_programs=programs, l2_loads=loads)
    assert none is None
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y0))
    S, per_pair = T * k, programs // (T * k)
    share = -(-D // per_pair)
    assert maxima.shape == (S * per_pair, 2) and maxima.dtype == jnp.uint32
    experts = _pair_experts(args[2], k, E, int(args[3]))
    flat = args[4]
    for p, got in enumerate(np.asarray(maxima)):
        e, c = experts[p // per_pair], p % per_pair
        rows = slice(c * share, min((c + 1) * share, D))
        want = [np.asarray(a[e, rows]).max(initial=0) for a in (flat.dn_words, flat.dn_scales)]
        np.testing.assert_array_equal(got, want, err_msg=f"L2 program {p}")


def test_down_l2_programs_tile_each_pairs_down_weights():
    """Independently of the split's formula: with words that count up (or down) through each expert, and scales
    that number the rows, the maxima give each L2 program's first and last word and row; per pair they tile its
    expert's words and rows exactly once, in whole rows, and name the pair's expert."""
    T, E, k, D, I, programs = 1, 8, 3, 96, 512, 10
    args, kw = _routed_inputs(np.random.default_rng(3), T, E, k, D, I)
    flat = args[4]
    n, W = flat.dn_words.shape[0], D * I // 8  # experts, words per expert
    idx = np.arange(n)[:, None] * W + np.arange(W)
    row = np.broadcast_to(np.arange(D)[None, :, None], flat.dn_scales.shape)
    got = {}
    for name, words, scales in (("up", idx + 1, row + 1), ("down", idx + W - 2 * np.arange(W), D - row)):
        kexp = flat.replace(
            dn_words=jnp.asarray(words.reshape(flat.dn_words.shape), jnp.uint32),
            dn_scales=jnp.asarray(scales, jnp.uint8),
        )
        got[name] = np.asarray(moe_gemv.routed(*args[:4], kexp, **kw, l2_programs=programs, l2_loads=2)[1], np.int64)
    per_pair = programs // (T * k)
    experts = _pair_experts(args[2], k, E, int(args[3]))
    for q, e in enumerate(experts):
        spans, rows = [], []
        for p in range(q * per_pair, (q + 1) * per_pair):
            last = got["up"][p, 0] - 1  # e * W + i
            first = (e + 1) * W - got["down"][p, 0]  # words (e + 1) W - i
            assert last // W == e and 0 <= first <= last % W, f"L2 program {p}: {first}, {last} (expert {e})"
            spans.append((first, last % W + 1))
            rows.append((D - got["down"][p, 1], got["up"][p, 1]))
        assert [a for a, _ in spans] == [0] + [b for _, b in spans[:-1]] and spans[-1][1] == W, spans
        assert [(a * 8 // I, b * 8 // I) for a, b in spans] == rows and all(a % (I // 8) == 0 for a, _ in spans)


def test_down_l2_programs_are_a_kernel_setting_at_one_token():
    """`moe_down_l2_programs` reaches the routed GEMV at 1 token only (off, 0, by default); 0 is its off, not an
    error, and a negative count or 0 loads are errors naming the field."""
    shape = (2880, 2880, 32, 4)
    gemv = lambda T, **kw: choose("moe", T, shape, jnp.bfloat16, H200, KernelConfig(impl="pallas", **kw)).kw["gemv"]  # noqa: E731
    assert gemv(1)["l2_programs"] == 0
    assert gemv(1, moe_down_l2_programs=180, moe_down_l2_loads=2).items() >= {("l2_programs", 180), ("l2_loads", 2)}
    assert gemv(4, moe_down_l2_programs=180)["l2_programs"] == 0
    for field, value in (("moe_down_l2_programs", -1), ("moe_down_l2_loads", 0)):
        with pytest.raises(ValueError, match=f"kernels.{field}={value}"):
            KernelConfig(**{field: value})


@pytest.mark.parametrize("preset", ["gpt-oss-20b", "gpt-oss-120b"])
def test_down_l2_programs_lower_for_cuda(preset):
    """The decode step at the real shapes with 180 L2 programs, lowered for CUDA on the CPU (tools/inspect_kernels'
    Hopper patches): they are one more row of 180 programs in the gate/up launch, their loads carry `evict_last`
    (Triton's evict = 3), and their maxima are a result of that launch in the step's StableHLO, so the loads stay
    (a pallas_call is one custom call: XLA runs it whole, since the down kernel reads its activation output)."""
    import dataclasses

    from tools import common, inspect_kernels

    cfg = common.model_config(preset)
    kernels = dataclasses.replace(inspect_kernels.BASE, moe_down_l2_programs=180).for_device(inspect_kernels.H200)
    step = common.decode_step(common.param_shapes(cfg, "pallas"), cfg, 1, 1024, kernels)
    found, backend = [], jax.default_backend()
    jax.clear_caches()
    with inspect_kernels.lowering_for_hopper(), inspect_kernels.capture_triton_modules(found):
        text = step.lower(lowering_platforms=("cuda",)).as_text()
    [gate_up] = {k["ir"]: k for k in found if k["name"] == "mxfp4_gate_up_swiglu_gemv16"}.values()
    assert gate_up["grid"] == (4 + 1, 180)
    assert "evict = 3 : i32" in gate_up["ir"]
    assert "tensor<180x2xui32>" in text
    assert jax.default_backend() == backend  # the patches are undone
