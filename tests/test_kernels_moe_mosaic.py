"""The Mosaic GPU mid-batch MoE (`pallas_kernels.moe_mosaic`): its dispatch, operand encodings and epilogues
against `moe_reference`. On CPU the kernels' jnp references (`gate_up_act_reference`, `down_out_reference`) stand
in (Mosaic's interpreter does not run register-operand wgmma); on a Hopper GPU the same tests run the kernels (as
does tools/check_kernels.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kernels_moe import ALPHA, LIMIT, _experts, _rel

import pallas_kernels
from pallas_kernels import expert_format, moe_mosaic, moe_reference


def test_mma_perm_is_a_permutation_pairing_each_threads_words():
    p = moe_mosaic.mma_perm()
    assert sorted(p) == list(range(moe_mosaic.TILE_K))
    # MMA columns 2c, 2c + 1 of every 8 are weights j and j + 4 of one word: that word's f16x2 pair
    assert np.all(p[1::2] - p[0::2] == 4)
    assert np.all(p[0::2] // 8 == p[1::2] // 8)
    # thread c (MMA columns 2c, 2c + 1 of every 8) reads whole 16-byte chunks c, c + 4, c + 8, c + 12 of each row
    chunks = (p // 32).reshape(16, 4, 4, 2).transpose(2, 0, 1, 3).reshape(4, -1)
    assert all(sorted(set(ch)) == [c, c + 4, c + 8, c + 12] for c, ch in enumerate(chunks))


def test_scale_exponents_restore_every_block_scale():
    """2^-14 (the decode) * 2^(byte - 15) (the f16 multiplier) * 2^(rowmax - 128) (the row factor) = 2^(s - 127)
    for every block; blocks 2^30 below their row's largest flush to 0."""
    s = jnp.asarray([[[120, 127, 100, 90]]], jnp.uint8)
    sexp, fac = moe_mosaic.scale_exponents(s)
    b = np.asarray(jax.lax.bitcast_convert_type(sexp, jnp.uint8)).reshape(4, 4)
    assert sexp.shape == (1, 1, moe_mosaic.TILE_K // 128)
    b = b.T.reshape(-1)  # u32 c holds blocks c, 4 + c, 8 + c, 12 + c: thread c's chunks
    np.testing.assert_array_equal(b[:4], [23, 30, 3, 0])
    assert np.all(b[4:] == 0)
    got = np.exp2(b[:3].astype(np.float64) - 15 - 14) * float(fac[0, 0])
    np.testing.assert_array_equal(got, np.exp2(np.asarray([120, 127, 100], np.float64) - 127))


def test_f16_operand_roundtrip():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(5, 600)) * np.array([1e-3, 1, 30, 1e4, 0])[:, None], jnp.float32)
    x16, fac = moe_mosaic.f16_operand(x)
    assert x16.shape == (5, 1024) and np.all(np.abs(np.asarray(x16, np.float32)) < 2**14)
    un = np.asarray(x16, np.float32).reshape(5, 2, 512)
    nat = np.zeros_like(un)
    nat[..., moe_mosaic.mma_perm()] = un
    np.testing.assert_allclose(
        nat.reshape(5, 1024)[:, :600] * np.asarray(fac)[:, None], np.asarray(x), rtol=2**-10, atol=0
    )
    assert np.all(nat.reshape(5, 1024)[:, 600:] == 0)


@pytest.mark.parametrize(
    "T,E,k,D,I,bm,empty",
    [
        (24, 8, 4, 576, 512, 16, True),  # K tail in the gate/up (D not a multiple of 512), an expert never routed
        (40, 4, 2, 512, 576, 8, False),  # K tail in the down; several slots per expert
        (9, 16, 4, 512, 512, 16, True),  # most slots empty
    ],
)
def test_experts_match_reference(T, E, k, D, I, bm, empty):
    rng = np.random.default_rng(T + E)
    ex = _experts(rng, E, D, I, jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(T, D)) * 2, jnp.bfloat16)
    rw = jnp.asarray(rng.normal(size=(E, D)) * 0.2, jnp.bfloat16)
    rb = np.zeros((E,), np.float32)
    if empty:
        rb[0] = -1e4
    idx, w, _ = moe_reference.route(x, rw, jnp.asarray(rb, jnp.bfloat16), k)
    ref = moe_reference.apply_experts(x, idx, w, ex, swiglu_limit=LIMIT, swiglu_alpha=ALPHA)
    out = moe_mosaic.experts(
        x, idx, w, expert_format.prepare_experts(ex), swiglu_limit=LIMIT, swiglu_alpha=ALPHA, block_m=bm
    )
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert _rel(out, ref) < 1e-2


def test_shapes_that_do_not_tile_are_refused():
    ex = expert_format.prepare_experts(_experts(np.random.default_rng(0), 4, 96, 512, jnp.bfloat16))
    assert not moe_mosaic.fits(96, 512)
    with pytest.raises(ValueError, match="D=96, I=512 do not tile"):
        moe_mosaic.experts(
            jnp.zeros((4, 96), jnp.bfloat16),
            jnp.zeros((4, 2), jnp.int32),
            jnp.ones((4, 2)),
            ex,
            swiglu_limit=LIMIT,
            swiglu_alpha=ALPHA,
        )


def test_stacked_layers_and_invalid_pairs():
    """With a leading layer axis the slots point into the flattened experts; pairs outside `valid_TK` add 0."""
    rng = np.random.default_rng(5)
    T, E, k, D, I = 12, 4, 2, 512, 512
    layers = [_experts(rng, E, D, I, jnp.bfloat16) for _ in range(3)]
    kx = jax.tree.map(lambda *a: jnp.stack(a), *[expert_format.prepare_experts(e) for e in layers])
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(0, E, (T, k)), jnp.int32)
    w = jnp.asarray(rng.random((T, k)), jnp.float32)
    valid = jnp.asarray(rng.random((T, k)) < 0.6).at[0].set(False)
    out = moe_mosaic.experts(x, idx, w, kx, jnp.int32(2), valid, swiglu_limit=LIMIT, swiglu_alpha=ALPHA, block_m=8)
    ref = moe_reference.apply_experts(
        x, idx, jnp.where(valid, w, 0.0), layers[2], swiglu_limit=LIMIT, swiglu_alpha=ALPHA
    )
    assert np.all(np.asarray(out[0], np.float32) == 0.0)
    assert _rel(out, ref) < 1e-2


def test_stored_scale_operands_give_the_same_output():
    """`prepare_params` on Hopper stores each layer's scale operands (`with_scale_operands`); the kernels then
    index the stacked arrays instead of deriving this layer's per call, with the same result. The stored
    arrays stay uncommitted like every other parameter (a committed one recompiled each warmed-up step)."""
    rng = np.random.default_rng(6)
    T, E, k, D, I = 12, 4, 2, 512, 512
    layers = [_experts(rng, E, D, I, jnp.bfloat16) for _ in range(3)]
    kx = jax.tree.map(lambda *a: jnp.stack(a), *[expert_format.prepare_experts(e) for e in layers])
    stored = pallas_kernels.with_scale_operands(kx)
    for layer in range(3):
        want = moe_mosaic.scale_operands(kx.gu_scales[layer], kx.dn_scales[layer])
        got = (stored.gu_sexp[layer], stored.gu_rowfac[layer], stored.dn_sexp[layer], stored.dn_rowfac[layer])
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert not any(a.committed for a in (stored.gu_sexp, stored.gu_rowfac, stored.dn_sexp, stored.dn_rowfac))
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(0, E, (T, k)), jnp.int32)
    w = jnp.asarray(rng.random((T, k)), jnp.float32)
    run = lambda ex: moe_mosaic.experts(
        x,
        idx,
        w,
        ex,
        jnp.int32(1),
        swiglu_limit=LIMIT,  # noqa: E731
        swiglu_alpha=ALPHA,
        block_m=8,
    )
    np.testing.assert_array_equal(np.asarray(run(stored), np.float32), np.asarray(run(kx), np.float32))


@pytest.mark.parametrize("I", [2880, 512, 576])
def test_act_positions_put_each_feature_where_the_down_reads_it(I):
    """The gate/up kernel stores stored row q (feature phase_order(I)[q]) at column act_positions(I)[q]; the
    down's K step t reads column 512t + m as natural feature 512t + mma_perm()[m]. Every feature lands once; the
    columns left over are the K padding past I."""
    pos = moe_mosaic.act_positions(I)
    assert len(set(pos.tolist())) == I and pos.min() >= 0 and pos.max() < -(-I // 512) * 512
    read_as = pos // 512 * 512 + moe_mosaic.mma_perm()[pos % 512]
    np.testing.assert_array_equal(read_as, expert_format.phase_order(I))


def test_act_exponent_keeps_the_activation_in_f16_range():
    """|SwiGLU| <= limit * (limit + 1); times 2^act_exponent, the largest such power, that bound stays within
    2^14, like the token operand."""
    for limit in (7.0, 1.0, 30.0, 0.5):
        bound, a = limit * (limit + 1), moe_mosaic.act_exponent(limit)
        assert bound * 2.0**a <= 2**14 < bound * 2.0 ** (a + 1)
    g = jnp.linspace(-50, 50, 1001)
    act = expert_format.clamped_swiglu(g[:, None], g[None, :], 7.0, ALPHA)
    assert float(jnp.max(jnp.abs(act))) <= 7.0 * 8.0


def test_unbounded_swiglu_limit_is_refused():
    ex = expert_format.prepare_experts(_experts(np.random.default_rng(0), 4, 512, 512, jnp.bfloat16))
    with pytest.raises(ValueError, match="swiglu_limit=inf"):
        moe_mosaic.experts(
            jnp.zeros((4, 512), jnp.bfloat16),
            jnp.zeros((4, 2), jnp.int32),
            jnp.ones((4, 2)),
            ex,
            swiglu_limit=float("inf"),
            swiglu_alpha=ALPHA,
        )
