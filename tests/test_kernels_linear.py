"""The decode projection kernel (CPU interpret mode) against its reference on fresh random inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import layer_index, linear_decode, linear_mosaic
from pallas_kernels.choice import H200, Device, KernelConfig

# Triton's fp32 dot runs in TF32 on GPUs (10-bit mantissa); the CPU interpreter computes in full fp32.
F32_TOL = 2e-3 if jax.default_backend() == "gpu" else 1e-5


def _reference(*args):
    """`linear_decode.reference` in full fp32: on GPUs XLA's default fp32 matmul runs in TF32 (~1e-3)."""
    with jax.default_matmul_precision("highest"):
        return linear_decode.reference(*args)


@pytest.mark.parametrize(
    "T,K,O,L,dtype,programs",
    [
        (1, 300, 40, 3, jnp.bfloat16, 528),
        (5, 256, 64, 2, jnp.float32, 1),
        (33, 520, 17, 2, jnp.bfloat16, 528),
        (33, 520, 17, 2, jnp.bfloat16, 2),
        (64, 128, 128, 1, jnp.float32, 528),
    ],
)
def test_linear_decode_matches_reference(T, K, O, L, dtype, programs):
    """Odd row counts, features not multiples of the blocks, K split evenly, unevenly (a last split with
    a step past K) or not at all, each layer of a stack read in place."""
    rng = np.random.default_rng(T * 1000 + K)
    x = jnp.asarray(rng.normal(size=(T, K)), dtype)
    w = jnp.asarray(rng.normal(size=(L, O, K)), dtype)
    b = jnp.asarray(rng.normal(size=(O,)), dtype)
    for layer in range(L):
        got = linear_decode.linear(x, w, b, jnp.int32(layer), block_k=128, programs=programs)
        want = _reference(x, w, b, layer)
        assert got.shape == (T, O) and got.dtype == jnp.float32
        tol = F32_TOL if dtype == jnp.float32 else 1e-2
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol * np.abs(want).max())
        # a different layer gives a different answer: the index is really used
        other = _reference(x, w, b, (layer + 1) % L)
        assert L == 1 or not np.allclose(np.asarray(got), np.asarray(other))


@pytest.mark.parametrize(
    "T,dtype,programs", [(1, jnp.float32, 528), (3, jnp.bfloat16, 528), (17, jnp.float32, 4), (64, jnp.bfloat16, 528)]
)
def test_linear_many_matches_reference_per_weight(T, dtype, programs):
    """q, k, v-like weights in one launch: outputs not multiples of block_n (72 = 2.25 tiles, 40), K not a
    multiple of block_k, a traced layer > 0 (layer 2 given as the layer scan gives it: counter 1 of `layer_index`'s
    2i). k and v have the same shape, and every weight and layer has its own values, so reading the neighbour's
    weight or another layer fails the comparison."""
    rng = np.random.default_rng(T)
    L, K, Os = 3, 300, (72, 40, 40)
    x_TI = jnp.asarray(rng.normal(size=(T, K)), dtype)
    ws_LOI = tuple(jnp.asarray(rng.normal(size=(L, O, K)), dtype) for O in Os)
    bs_O = tuple(jnp.asarray(rng.normal(size=(O,)), dtype) for O in Os)
    run = jax.jit(lambda x, ws, bs, layer: linear_decode.linear_many(x, ws, bs, layer, block_k=128, programs=programs))
    jaxpr = jax.make_jaxpr(run)(x_TI, ws_LOI, bs_O, jnp.int32(0))
    assert str(jaxpr).count("pallas_call[") == 1  # one launch for all three
    tol = F32_TOL if dtype == jnp.float32 else 1e-2
    for layer, given in ((2, layer_index.LayerIndex(jnp.int32(1), 2, 0)), (1, jnp.int32(1))):
        got = run(x_TI, ws_LOI, bs_O, given)
        assert len(got) == len(Os)
        for i, (y, O) in enumerate(zip(got, Os)):
            assert y.shape == (T, O) and y.dtype == jnp.float32
            want = _reference(x_TI, ws_LOI[i], bs_O[i], layer)
            np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=tol, atol=tol * np.abs(want).max())
            others = [_reference(x_TI, ws_LOI[i], bs_O[i], l) for l in range(L) if l != layer]
            others += [_reference(x_TI, ws_LOI[j], bs_O[j], layer) for j in range(len(Os)) if j != i and Os[j] == O]
            assert all(
                not np.allclose(np.asarray(y), np.asarray(o), rtol=tol, atol=tol * np.abs(o).max()) for o in others
            )


def test_a_step_that_is_not_live_reads_no_weight():
    """A step without tokens (`LayerIndex.live` 0): every output tile is zeros, whatever the weights
    (NaN here: a tile that read them would show), so the step's later kernels read finite values."""
    rng = np.random.default_rng(3)
    x_TI = jnp.asarray(rng.normal(size=(4, 300)), jnp.bfloat16)
    ws_LOI = (jnp.full((2, 72, 300), jnp.nan, jnp.bfloat16), jnp.full((2, 40, 300), jnp.nan, jnp.bfloat16))
    dead, live = (layer_index.LayerIndex(jnp.int32(0), 2, 1, live=jnp.asarray([on], jnp.int32)) for on in (0, 1))
    for y in linear_decode.partial_sums(x_TI, ws_LOI, dead, block_k=128, programs=64):
        assert not np.asarray(y).any()
    assert all(np.isnan(np.asarray(y)).all() for y in linear_decode.partial_sums(x_TI, ws_LOI, live, block_k=128))


def test_split_k_covers_k_once():
    for O, K, bn, bk, programs in [
        (4096, 2880, 32, 256, 528),
        (2880, 4096, 32, 256, 528),
        (17, 520, 32, 128, 2),
        (512, 2880, 32, 256, 528),
        (64, 100, 16, 128, 1000),
    ]:
        splits, per = linear_decode.split_k(O, K, bn, bk, programs)
        steps = -(-K // bk)
        assert splits * per >= steps > (splits - 1) * per  # every step once, no empty split


def test_linear_decode_rejects_prefill_sizes():
    x = jnp.zeros((linear_decode.MAX_ROWS + 1, 32))
    with pytest.raises(AssertionError):
        linear_decode.linear(x, jnp.zeros((1, 16, 32)), jnp.zeros(16), 0)


def _mosaic_case(rng, T, Os, K, L):
    x = jnp.asarray(rng.normal(size=(T, K)), jnp.bfloat16)
    ws = tuple(jnp.asarray(rng.normal(size=(L, O, K)) * 0.05, jnp.bfloat16) for O in Os)
    bs = tuple(jnp.asarray(rng.normal(size=(O,)), jnp.bfloat16) for O in Os)
    return x, ws, bs


@pytest.mark.skipif(
    not Device.current().hopper,
    reason="the Mosaic projection kernel runs on Hopper GPUs only "
    "(Mosaic's interpreter lacks inline_mgpu and TMA reduce-add); tools/check_kernels.py runs it too",
)
@pytest.mark.parametrize(
    "T,Os,K,splits",
    [
        (2, (4096, 512, 512), 2880, None),
        (9, (200, 64), 640, 2),
        (100, (2880,), 4096, None),
        (256, (4096, 512, 512), 2880, 45),
        (256, (72, 136), 512, 1),
    ],
)
def test_linear_mosaic_matches_reference(T, Os, K, splits):
    """Ragged row counts (padded to the token tile), weights whose rows end inside a CTA's 128 or a warpgroup's
    64, K split so the splits meet by reduce-add (45: one step each) or not at all, a traced layer > 0; each
    weight and layer has its own values, so reading a neighbour fails."""
    rng = np.random.default_rng(T + K)
    L = 3
    x, ws, bs = _mosaic_case(rng, T, Os, K, L)
    cfg = linear_mosaic.config(T, K, Os, Device.current().num_sms)
    if splits:
        cfg = dict(splits=splits, stages=2)
    for layer in (L - 1, 1):
        got = linear_mosaic.linear_many(x, ws, bs, jnp.int32(layer), **cfg)
        for y, w, b in zip(got, ws, bs):
            want = np.asarray(_reference(x, w, b, layer))
            assert y.shape == want.shape and y.dtype == jnp.float32
            np.testing.assert_allclose(np.asarray(y), want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
            other = np.asarray(_reference(x, w, b, layer - 1))
            assert not np.allclose(np.asarray(y), other, rtol=1e-2, atol=1e-2 * np.abs(other).max())


@pytest.mark.parametrize(
    "T,I,Os,sms",
    [
        (256, 2880, (4096, 512, 512), 132),
        (1, 4096, (2880,), 132),
        (64, 2880, (5120, 1024, 1024), 78),
        (150, 640, (200, 64), 132),
        (256, 128, (8192,), 16),
    ],
)
def test_linear_mosaic_config_is_one_wave_within_shared_memory(T, I, Os, sms):
    cfg = linear_mosaic.config(T, I, Os, num_sms=sms)
    nk = I // linear_mosaic.TILE_K
    tiles = sum(-(-O // linear_mosaic.CTA_ROWS) for O in Os)
    assert nk % cfg["splits"] == 0
    assert cfg["splits"] == 1 or (tiles * cfg["splits"] <= sms and nk // cfg["splits"] >= 4)
    # the most splits with those properties
    assert not any(nk % d == 0 and nk // d >= 4 and tiles * d <= sms for d in range(cfg["splits"] + 1, nk + 1))
    Tn = linear_mosaic.padded_tokens(T)
    stage = (linear_mosaic.CTA_ROWS + Tn) * linear_mosaic.TILE_K * 2
    epilogue = 2 * min(linear_mosaic.EPI_TOKENS, Tn) * linear_mosaic.ROWS * 4
    assert 2 <= cfg["stages"] <= 8 and cfg["stages"] * stage + epilogue <= linear_mosaic.SMEM_BYTES


def test_linear_mosaic_token_tile_and_limits():
    assert [linear_mosaic.padded_tokens(T) for T in (1, 8, 9, 64, 65, 200, 256)] == [8, 8, 16, 64, 128, 256, 256]
    assert linear_mosaic.fits(256, 2880, jnp.bfloat16) and linear_mosaic.fits(1, 64, jnp.float16)
    assert not linear_mosaic.fits(257, 2880, jnp.bfloat16)  # wgmma N and the TMA box stop at 256
    assert not linear_mosaic.fits(8, 2880 + 32, jnp.bfloat16)  # K in whole 64-element steps
    assert not linear_mosaic.fits(8, 2880, jnp.float32)  # wgmma reads 16-bit operands from shared memory


@pytest.mark.parametrize(
    "T,want", [(1, "triton"), (7, "triton"), (8, "mosaic"), (64, "mosaic"), (256, "mosaic"), (257, "reference")]
)
def test_linear_many_dispatch_on_hopper(monkeypatch, T, want):
    """Which kernel `pallas_kernels.linear_many` runs for T rows when the Mosaic kernel is available (recorded
    by stand-ins: this checks the routing, the tests above check the kernels)."""
    import pallas_kernels

    ran = []

    def record(name, fn):
        return lambda *a, **kw: ran.append(name) or fn(*a)  # the launch settings do not change the function

    ref = linear_decode.reference
    ref_many = lambda x, ws, bs, layer: tuple(ref(x, w, b, layer) for w, b in zip(ws, bs))  # noqa: E731
    ref_parts = lambda x, ws, layer: tuple(ref(x, w, jnp.float32(0), layer)[None] for w in ws)  # noqa: E731
    monkeypatch.setattr(linear_mosaic, "linear_many", record("mosaic", ref_many))
    monkeypatch.setattr(linear_decode, "partial_sums", record("triton", ref_parts))
    monkeypatch.setattr(linear_decode, "reference", record("reference", ref))
    rng = np.random.default_rng(T)
    x, ws, bs = _mosaic_case(rng, T, (128, 64), 128, 2)
    got = pallas_kernels.linear_many(x, ws, bs, 1, kernels=KernelConfig(impl="pallas").for_device(H200))
    assert ran and set(ran) == {want}
    assert [y.shape for y in got] == [(T, 128), (T, 64)]
    want_y = ref_many(x, ws, bs, 1)
    for y, w in zip(got, want_y):  # the partial sums come back summed, with the biases
        np.testing.assert_allclose(np.asarray(y), np.asarray(w), rtol=1e-6, atol=1e-6)
