import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gptoss_jax import sampling


def _allowed(logits, temp, top_k, top_p, min_p):
    """Brute force: sort the whole row, apply each filter literally."""
    s = logits / temp
    order = np.argsort(-s)
    p = np.exp(s[order] - s.max())
    p /= p.sum()
    keep = (np.cumsum(p) - p) < top_p
    if top_k > 0:
        keep &= np.arange(len(s)) < top_k
    keep &= p >= min_p * p[0]
    keep[0] = True
    return set(order[keep].tolist())


@pytest.mark.parametrize("V", [300, 3000])
def test_draws_stay_inside_the_filtered_set(V):
    """Covers both the candidate path and the full-sort fallback (top_k beyond the candidates)."""
    rng = np.random.default_rng(V)
    B = 48
    logits = (rng.standard_normal((B, V)) * rng.uniform(0.1, 8, (B, 1))).astype(np.float32)
    temp = rng.choice([0.5, 1.0, 1.7], B).astype(np.float32)
    top_k = rng.choice([0, 1, 5, 50, 2000], B).astype(np.int32)
    top_p = rng.choice([1.0, 0.9, 0.5], B).astype(np.float32)
    min_p = rng.choice([0.0, 0.05, 0.3], B).astype(np.float32)
    f = jax.jit(sampling.sample)
    keys = jnp.stack([jax.random.PRNGKey(i) for i in range(B)])
    draws = np.stack([np.asarray(f(jnp.asarray(logits), jax.vmap(jax.random.fold_in)(keys, jnp.full(B, r)),
                                   jnp.asarray(temp), jnp.asarray(top_k), jnp.asarray(top_p), jnp.asarray(min_p)))
                      for r in range(12)], axis=1)
    for b in range(B):
        allowed = _allowed(logits[b], temp[b], top_k[b], top_p[b], min_p[b])
        assert set(draws[b].tolist()) <= allowed, b
        if len(allowed) == 1:
            assert set(draws[b].tolist()) == allowed


def test_draw_frequencies_follow_the_distribution():
    logits = np.log(np.array([[0.5, 0.3, 0.2, 1e-9]], np.float32))
    f = jax.jit(jax.vmap(lambda k: sampling.sample(jnp.asarray(logits), k[None], jnp.ones(1), jnp.zeros(1, jnp.int32),
                                                   jnp.ones(1), jnp.zeros(1))[0]))
    draws = np.asarray(f(jax.random.split(jax.random.PRNGKey(0), 4000)))
    freq = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(freq[:3], [0.5, 0.3, 0.2], atol=0.03)


def test_draws_across_draw_blocks_follow_the_distribution():
    """Mass spread over several `DRAW_BLOCK`s of a vocabulary that is not a multiple of it, with
    temperature only (the path that skips the candidates)."""
    V = 3 * sampling.DRAW_BLOCK + 77
    where, probs = [5, sampling.DRAW_BLOCK + 3, 3 * sampling.DRAW_BLOCK + 76, 2 * sampling.DRAW_BLOCK], [.4, .3, .2, .1]
    logits = np.full((1, V), -1e9, np.float32)
    logits[0, where] = np.log(probs)
    f = jax.jit(jax.vmap(lambda k: sampling.sample(jnp.asarray(logits), k[None], jnp.ones(1), jnp.zeros(1, jnp.int32),
                                                   jnp.ones(1), jnp.zeros(1))[0]))
    draws = np.asarray(f(jax.random.split(jax.random.PRNGKey(1), 4000)))
    assert set(draws.tolist()) <= set(where)
    freq = np.array([np.mean(draws == t) for t in where])
    np.testing.assert_allclose(freq, probs, atol=0.03)
