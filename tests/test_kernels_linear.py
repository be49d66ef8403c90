"""The decode projection kernel (CPU interpret mode) against its reference on fresh random inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import linear_decode


@pytest.mark.parametrize("T,K,O,L,dtype,programs", [
    (1, 300, 40, 3, jnp.bfloat16, 528), (5, 256, 64, 2, jnp.float32, 1), (33, 520, 17, 2, jnp.bfloat16, 528),
    (33, 520, 17, 2, jnp.bfloat16, 2), (64, 128, 128, 1, jnp.float32, 528)])
def test_linear_decode_matches_reference(T, K, O, L, dtype, programs):
    """Odd row counts, features not multiples of the blocks, K split evenly, unevenly (a last split with
    a step past K) or not at all, each layer of a stack read in place."""
    rng = np.random.default_rng(T * 1000 + K)
    x = jnp.asarray(rng.normal(size=(T, K)), dtype)
    w = jnp.asarray(rng.normal(size=(L, O, K)), dtype)
    b = jnp.asarray(rng.normal(size=(O,)), dtype)
    for layer in range(L):
        got = linear_decode.linear(x, w, b, jnp.int32(layer), block_k=128, programs=programs)
        want = linear_decode.reference(x, w, b, layer)
        assert got.shape == (T, O) and got.dtype == jnp.float32
        tol = 1e-5 if dtype == jnp.float32 else 1e-2
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol * np.abs(want).max())
        # a different layer gives a different answer: the index is really used
        other = linear_decode.reference(x, w, b, (layer + 1) % L)
        assert L == 1 or not np.allclose(np.asarray(got), np.asarray(other))


@pytest.mark.parametrize("T,dtype,programs", [(1, jnp.float32, 528), (3, jnp.bfloat16, 528), (17, jnp.float32, 4),
                                               (64, jnp.bfloat16, 528)])
def test_linear_many_matches_reference_per_weight(T, dtype, programs):
    """q, k, v-like weights in one launch: outputs not multiples of block_n (72 = 2.25 tiles, 40), K not a
    multiple of block_k, a traced layer > 0. k and v have the same shape, and every weight and layer has
    its own values, so reading the neighbour's weight or another layer fails the comparison."""
    rng = np.random.default_rng(T)
    L, K, Os = 3, 300, (72, 40, 40)
    x_TI = jnp.asarray(rng.normal(size=(T, K)), dtype)
    ws_LOI = tuple(jnp.asarray(rng.normal(size=(L, O, K)), dtype) for O in Os)
    bs_O = tuple(jnp.asarray(rng.normal(size=(O,)), dtype) for O in Os)
    run = jax.jit(lambda x, ws, bs, layer: linear_decode.linear_many(x, ws, bs, layer, block_k=128,
                                                                     programs=programs))
    jaxpr = jax.make_jaxpr(run)(x_TI, ws_LOI, bs_O, jnp.int32(0))
    assert str(jaxpr).count("pallas_call[") == 1  # one launch for all three
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    for layer in (2, 1):
        got = run(x_TI, ws_LOI, bs_O, jnp.int32(layer))
        assert len(got) == len(Os)
        for i, (y, O) in enumerate(zip(got, Os)):
            assert y.shape == (T, O) and y.dtype == jnp.float32
            want = linear_decode.reference(x_TI, ws_LOI[i], bs_O[i], layer)
            np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=tol, atol=tol * np.abs(want).max())
            others = [linear_decode.reference(x_TI, ws_LOI[i], bs_O[i], l) for l in range(L) if l != layer]
            others += [linear_decode.reference(x_TI, ws_LOI[j], bs_O[j], layer) for j in range(len(Os))
                       if j != i and Os[j] == O]
            assert all(not np.allclose(np.asarray(y), np.asarray(o), rtol=tol, atol=tol * np.abs(o).max())
                       for o in others)


def test_split_k_covers_k_once():
    for O, K, bn, bk, programs in [(4096, 2880, 32, 256, 528), (2880, 4096, 32, 256, 528), (17, 520, 32, 128, 2),
                                   (512, 2880, 32, 256, 528), (64, 100, 16, 128, 1000)]:
        splits, per = linear_decode.split_k(O, K, bn, bk, programs)
        steps = -(-K // bk)
        assert splits * per >= steps > (splits - 1) * per  # every step once, no empty split


def test_linear_decode_rejects_prefill_sizes():
    x = jnp.zeros((linear_decode.MAX_ROWS + 1, 32))
    with pytest.raises(AssertionError):
        linear_decode.linear(x, jnp.zeros((1, 16, 32)), jnp.zeros(16), 0)
