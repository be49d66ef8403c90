"""The decode projection kernel (CPU interpret mode) against its reference on fresh random inputs."""

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
