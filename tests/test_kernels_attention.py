"""The Pallas paged decode and prefill attention kernels (CPU interpret mode) against the pure-JAX reference."""

import numpy as np
import jax.numpy as jnp
import pytest

from pallas_kernels import attention_reference, flash_attention, paged_attention

FULL = 2**31 - 1


def _case(seed, B, N, K, H, S, ctxs, sink_scale):
    rng = np.random.default_rng(seed)
    M = max((c + S - 1) // S for c in ctxs) + 1
    P = B * M + 1
    kp = jnp.asarray(rng.normal(size=(P, S, K, H)), jnp.bfloat16)
    vp = jnp.asarray(rng.normal(size=(P, S, K, H)), jnp.bfloat16)
    bt = jnp.asarray(rng.permutation(np.arange(1, P))[:B * M].reshape(B, M).astype(np.int32))
    pos = jnp.asarray(np.array(ctxs, np.int32)[:, None] - 1)  # ctx 0 -> position -1 (padding row)
    q = jnp.asarray(rng.normal(size=(B, 1, N, H)), jnp.bfloat16)
    sinks = jnp.asarray(rng.normal(size=(N,)) * sink_scale, jnp.float32)
    return q, kp, vp, bt, pos, sinks


@pytest.mark.parametrize("window,S,ctxs,sink_scale,splits", [
    (FULL, 16, [1, 37, 200], 1.0, 1),
    (FULL, 16, [1, 37, 200], 1.0, 3),
    (128, 8, [5, 130, 300, 0], 30.0, 2),   # shorter and longer than the window, a padded row, big sinks
    (128, 32, [129, 64], 1.0, 1),
])
def test_paged_decode_matches_reference(window, S, ctxs, sink_scale, splits):
    B = len(ctxs)
    q, kp, vp, bt, pos, sinks = _case(len(ctxs) * 10 + S, B, 16, 2, 64, S, ctxs, sink_scale)
    ref = attention_reference.attention(q, kp, vp, bt, pos, sinks, window)
    out = paged_attention.attention(q, kp, vp, bt, pos, sinks, window, block_kv=32,
                                    num_splits=splits, interpret=True)
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2
    if 0 in ctxs:
        assert np.abs(out[ctxs.index(0)]).max() == 0.0


def _prefill_case(seed, N, K, H, S, chunks, T, sink_scale, dtype=jnp.bfloat16):
    """Rows (start, length): queries at start .. start+length-1 (then padding, pos -1) over keys 0 .. end."""
    rng = np.random.default_rng(seed)
    B = len(chunks)
    M = max((s + n + S - 1) // S for s, n in chunks) + 1
    P = B * M + 1
    kp = jnp.asarray(rng.normal(size=(P, S, K, H)), dtype)
    vp = jnp.asarray(rng.normal(size=(P, S, K, H)), dtype)
    bt = jnp.asarray(rng.permutation(np.arange(1, P))[:B * M].reshape(B, M).astype(np.int32))
    pos = np.full((B, T), -1, np.int32)
    for b, (s, n) in enumerate(chunks):
        pos[b, :n] = np.arange(s, s + n)
    q = jnp.asarray(rng.normal(size=(B, T, N, H)), dtype)
    sinks = jnp.asarray(rng.normal(size=(N,)) * sink_scale, jnp.float32)
    return q, kp, vp, bt, jnp.asarray(pos), sinks


@pytest.mark.parametrize("window,S,chunks,T,sink_scale,block_q", [
    (FULL, 4, [(0, 21), (9, 5), (0, 0)], 21, 1.0, 16),     # causal from 0, a continuation chunk, an all-padding row
    (8, 4, [(0, 21), (30, 13), (3, 2)], 21, 30.0, 16),     # chunks longer / shorter than the window, big sinks
    (8, 8, [(17, 6)], 6, 1.0, 32),                         # one tile; keys 0-7 are NaN: must be skipped
])
def test_prefill_flash_matches_reference(window, S, chunks, T, sink_scale, block_q):
    q, kp, vp, bt, pos, sinks = _prefill_case(len(chunks) + S, 8, 2, 16, S, chunks, T, sink_scale)
    if chunks == [(17, 6)]:  # block 0 lies wholly before every query's window: poison it
        kp, vp = kp.at[bt[0, 0]].set(jnp.nan), vp.at[bt[0, 0]].set(jnp.nan)
    ref = attention_reference.attention(q, kp, vp, bt, pos, sinks, window)
    out = flash_attention.attention(q, kp, vp, bt, pos, sinks, window, block_q=block_q, block_kv=8,
                                    interpret=True)
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2
    pad = np.asarray(pos) < 0
    assert np.abs(out[pad]).max(initial=0.0) == 0.0
