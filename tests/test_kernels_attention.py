"""The Pallas paged decode and prefill attention kernels (CPU interpret mode) against the pure-JAX reference."""

import functools
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from gptoss_jax import config, model
from gptoss_jax.random_weights import random_params
from pallas_kernels import KernelConfig, attention_reference, flash_attention, kv_quant, layer_index, paged_attention
from pallas_kernels.choice import CPU

FULL = 2**31 - 1


def _case(seed, B, N, K, H, S, ctxs, sink_scale):
    rng = np.random.default_rng(seed)
    M = max((c + S - 1) // S for c in ctxs) + 1
    P = B * M + 1
    kp = jnp.asarray(rng.normal(size=(P, S, K, H)), jnp.bfloat16)
    vp = jnp.asarray(rng.normal(size=(P, S, K, H)), jnp.bfloat16)
    bt = jnp.asarray(rng.permutation(np.arange(1, P))[: B * M].reshape(B, M).astype(np.int32))
    pos = jnp.asarray(np.array(ctxs, np.int32)[:, None] - 1)  # ctx 0 -> position -1 (padding row)
    q = jnp.asarray(rng.normal(size=(B, 1, N, H)), jnp.bfloat16)
    sinks = jnp.asarray(rng.normal(size=(N,)) * sink_scale, jnp.float32)
    return q, kp, vp, bt, pos, sinks


@pytest.mark.parametrize(
    "window,S,ctxs,sink_scale,splits",
    [
        (FULL, 16, [1, 37, 200], 1.0, 1),
        (FULL, 16, [1, 37, 200], 1.0, 3),
        (128, 8, [5, 130, 300, 0], 30.0, 2),  # shorter and longer than the window, a padded row, big sinks
        (128, 32, [129, 64], 1.0, 1),
    ],
)
def test_paged_decode_matches_reference(window, S, ctxs, sink_scale, splits):
    B = len(ctxs)
    q, kp, vp, bt, pos, sinks = _case(len(ctxs) * 10 + S, B, 16, 2, 64, S, ctxs, sink_scale)
    ref = attention_reference.attention(q, kp, vp, bt, pos, sinks, window)
    out = paged_attention.attention(q, kp, vp, bt, pos, sinks, window, block_kv=32, num_splits=splits, interpret=True)
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
    bt = jnp.asarray(rng.permutation(np.arange(1, P))[: B * M].reshape(B, M).astype(np.int32))
    pos = np.full((B, T), -1, np.int32)
    for b, (s, n) in enumerate(chunks):
        pos[b, :n] = np.arange(s, s + n)
    q = jnp.asarray(rng.normal(size=(B, T, N, H)), dtype)
    sinks = jnp.asarray(rng.normal(size=(N,)) * sink_scale, jnp.float32)
    return q, kp, vp, bt, jnp.asarray(pos), sinks


@pytest.mark.parametrize(
    "window,S,chunks,T,sink_scale,block_q",
    [
        (FULL, 4, [(0, 21), (9, 5), (0, 0)], 21, 1.0, 16),  # causal from 0, a continuation chunk, an all-padding row
        (8, 4, [(0, 21), (30, 13), (3, 2)], 21, 30.0, 16),  # chunks longer / shorter than the window, big sinks
        (8, 8, [(17, 6)], 6, 1.0, 32),  # one tile; keys 0-7 are NaN: must be skipped
        # a window of three blocks: blocks wholly inside it take the unmasked loop, its edges the masked one
        (24, 4, [(0, 40), (50, 37), (5, 1)], 40, 1.0, 16),
    ],
)
def test_prefill_flash_matches_reference(window, S, chunks, T, sink_scale, block_q):
    q, kp, vp, bt, pos, sinks = _prefill_case(len(chunks) + S, 8, 2, 16, S, chunks, T, sink_scale)
    if chunks == [(17, 6)]:  # block 0 lies wholly before every query's window: poison it
        kp, vp = kp.at[bt[0, 0]].set(jnp.nan), vp.at[bt[0, 0]].set(jnp.nan)
    ref = attention_reference.attention(q, kp, vp, bt, pos, sinks, window)
    out = flash_attention.attention(q, kp, vp, bt, pos, sinks, window, block_q=block_q, block_kv=8, interpret=True)
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2
    pad = np.asarray(pos) < 0
    assert np.abs(out[pad]).max(initial=0.0) == 0.0


@pytest.mark.parametrize("window", [FULL, 8])
def test_a_few_tokens_per_row_take_the_decode_kernel_and_match_reference(window):
    """A verify step's rows (k + 1 tokens at consecutive positions, or one token for a row that does not draft, or
    padding) with their K/V written already (several devices, inspection) attend through the decode kernel, one
    query row per token, each to its own causal prefix."""
    chunks = [(0, 4), (19, 4), (30, 1), (0, 0)]
    q, kp, vp, bt, pos, sinks = _prefill_case(7, 8, 2, 16, 4, chunks, 4, 5.0)
    kernels = KernelConfig(impl="pallas", new_token_rows=8)
    assert pallas_kernels.choose("attention", 4, (4, 8, 2, 16), q.dtype, CPU, kernels).kernel == "paged_rows"
    assert pallas_kernels.choose("attention", 4, (9, 8, 2, 16), q.dtype, CPU, kernels).kernel == "flash"
    ref = attention_reference.attention(q, kp, vp, bt, pos, sinks, window)
    out = pallas_kernels.attention(q, kp, vp, bt, pos, sinks, window, kernels=kernels.for_device(CPU))
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2
    assert np.abs(out[np.asarray(pos) < 0]).max(initial=0.0) == 0.0


@pytest.mark.parametrize(
    "window,S,splits,sink_scale,counter",
    [
        (FULL, 8, 1, 1.0, False),
        (FULL, 8, 3, 1.0, True),
        (16, 4, 2, 30.0, False),
        (FULL, 4, 11, 5.0, False),
        (16, 4, None, 30.0, True),
    ],
)  # 11: two merge chunks, idle splits; None: the default (4 here, as many as the window can cover)
def test_new_token_attention_matches_reference(window, S, splits, sink_scale, counter):
    """Rows: fresh tokens at position 0, inside and past the window, a long context; a padding row; a row
    whose position is prefix-cached (null-page write: its key comes from the cache). Layer 1 of a 2-layer pool,
    layer 2 of the stacked biases and sinks: given as numbers, or (`counter`) as the layer scan gives them, counter
    1 of a `LayerIndex` (layer 2i, page offset P i) with no page offset."""
    rng = np.random.default_rng(S * 10 + (splits or 0))
    N, K, H, parts_n = 8, 2, 16, 3
    pos = np.array([0, 5, 17, 61, -1, 40], np.int32)
    B, M = len(pos), 64 // S + 1
    P = B * M + 1  # pages per layer; page 0 is the null page
    kp = jnp.asarray(rng.normal(size=(2 * P, S, K, H)), jnp.bfloat16)
    vp = jnp.asarray(rng.normal(size=(2 * P, S, K, H)), jnp.bfloat16)
    bt = rng.permutation(np.arange(1, P))[: B * M].reshape(B, M).astype(np.int32)
    wpage = np.where(pos >= 0, bt[np.arange(B), np.maximum(pos, 0) // S], 0)
    wpage[5] = 0  # prefix-cached: not written, read from the cache
    wslot = np.maximum(pos, 0) % S
    parts = tuple(jnp.asarray(rng.normal(size=(parts_n, B, n * H)), jnp.float32) for n in (N, K, K))
    biases = tuple(jnp.asarray(rng.normal(size=(3, n * H)), jnp.bfloat16) for n in (N, K, K))  # 3 layers
    angle = rng.uniform(0, 6.3, size=(B, H // 2))
    cos, sin = (jnp.asarray(f(angle) * 1.3, jnp.bfloat16) for f in (np.cos, np.sin))
    sinks = jnp.asarray(rng.normal(size=(3, N)) * sink_scale, jnp.float32)  # 3 layers, like the biases
    rest = (jnp.asarray(pos), jnp.asarray(wpage), jnp.asarray(wslot), sinks, window)
    ref, ref_k, ref_v, *_ = paged_attention.new_token_reference(parts, biases, 2, cos, sin, kp, vp, bt, P, *rest)
    layer, offset = (layer_index.LayerIndex(jnp.int32(1), 2, 0, P), None) if counter else (2, P)
    out, got_k, got_v, done, *_ = paged_attention.attention_new_token(
        parts, biases, layer, cos, sin, kp, vp, bt, offset, *rest, block_kv=8, num_splits=splits, interpret=True
    )
    assert not np.asarray(done).any()  # the last split of each (row, KV head) reset its count for the next launch
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2
    assert np.abs(out[4]).max() == 0.0  # the padding row
    # Written where the reference writes, except the null page (the kernel skips those writes).
    keep = np.ones(2 * P, bool)
    keep[P] = False
    for got, want, before in ((got_k, ref_k, kp), (got_v, ref_v, vp)):
        got, want = np.asarray(got, np.float32)[keep], np.asarray(want, np.float32)[keep]
        assert (want != np.asarray(before, np.float32)[keep]).any(axis=(1, 2, 3)).sum() == 4  # the fresh rows
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("window,S,splits,fp8", [(FULL, 4, 1, False), (16, 8, 3, False), (FULL, 4, 2, True)])
def test_new_token_attention_of_a_few_tokens_a_row_matches_reference(window, S, splits, fp8):
    """A verify step's rows through the new-token kernel, 4 tokens a row, each attending to the cache and to its
    row's earlier new tokens (which the kernel takes from their projections, not from the pools being written):
    tokens from position 0 (no cache), across a page boundary, one token and padding, all padding, two
    prefix-cached (null-page) tokens before two fresh ones, a long context past a sliding window."""
    rng = np.random.default_rng(S * 10 + splits + fp8)
    N, K, H, T = 8, 2, 16, 4
    starts = [0, 14, 30, -1, 40, 61]
    pos = np.array([[s + i if s >= 0 and (s != 30 or i == 0) else -1 for i in range(T)] for s in starts], np.int32)
    B, M = len(starts), 80 // S + 1
    P = B * M + 1  # pages per layer; page 0 is the null page
    kp, vp = (rng.normal(size=(2 * P, S, K, H)) for _ in "kv")
    scales = {}
    if fp8:
        (kp, ks), (vp, vs) = _fp8(kp, rng), _fp8(vp, rng, values=True)
        scales = dict(k_scale_PKS=ks, v_scale_PKS=vs)
    else:
        kp, vp = jnp.asarray(kp, jnp.bfloat16), jnp.asarray(vp, jnp.bfloat16)
    bt = rng.permutation(np.arange(1, P))[: B * M].reshape(B, M).astype(np.int32)
    wpage = np.where(pos >= 0, bt[np.arange(B)[:, None], np.maximum(pos, 0) // S], 0)
    wpage[4, :2] = 0  # prefix-cached: not written, read from the cache
    wslot = np.maximum(pos, 0) % S
    R = B * T
    parts = tuple(jnp.asarray(rng.normal(size=(3, R, n * H)), jnp.float32) for n in (N, K, K))
    biases = tuple(jnp.asarray(rng.normal(size=(3, n * H)), jnp.bfloat16) for n in (N, K, K))
    angle = rng.uniform(0, 6.3, size=(R, H // 2))
    cos, sin = (jnp.asarray(f(angle), jnp.bfloat16) for f in (np.cos, np.sin))
    sinks = jnp.asarray(rng.normal(size=(3, N)), jnp.float32)
    flat = lambda a: jnp.asarray(a.reshape(R))  # noqa: E731
    args = (parts, biases, 2, cos, sin, kp, vp, jnp.asarray(bt), P, flat(pos), flat(wpage), flat(wslot), sinks, window)
    kw = dict(scales, tokens_per_row=T)
    ref, *ref_pools = paged_attention.new_token_reference(*args, **kw)
    out, *got = paged_attention.attention_new_token(*args, **kw, block_kv=8, num_splits=splits, interpret=True)
    done = got.pop(2)
    assert not np.asarray(done).any() and done.shape == (R, K)
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all()
    valid = pos.reshape(R) >= 0
    for r in np.flatnonzero(valid):  # every token on its own: an error in one row's causal prefix shows
        assert np.linalg.norm(out[r] - ref[r]) / np.linalg.norm(ref[r]) < 2e-2, (r, pos.reshape(R)[r])
    assert np.abs(out[~valid]).max() == 0.0  # padding
    keep = np.ones(2 * P, bool)
    keep[P] = False  # the null page of layer 1: the reference writes there, the kernel skips it
    fresh = int(((pos >= 0) & (wpage != 0)).sum())
    written = set(bt[np.arange(B)[:, None], np.maximum(pos, 0) // S][(pos >= 0) & (wpage != 0)] + P)
    for got_a, want, before in zip(got, ref_pools, (kp, vp, *scales.values())):
        got_a, want, before = (np.asarray(a, np.float32) for a in (got_a, want, before))
        changed = set(np.flatnonzero((want != before).reshape(len(want), -1).any(axis=1))) - {P}
        assert changed == written and fresh == 15
        np.testing.assert_allclose(got_a[keep], want[keep], rtol=1e-2, atol=1e-2)


@pytest.mark.slow  # the whole model on the interpreted kernels
@pytest.mark.parametrize("T", [1, 3])
def test_decode_step_takes_the_new_token_kernel_and_matches_reference(monkeypatch, T):
    """A bf16 decode step of the tiny model with the kernels, one token a row or a verify step's three: each layer
    runs `attention_new_token` (spied), and the hidden states and every written cache slot match the reference
    path's from the same cache."""
    cfg = config.from_hf_dict(json.loads((Path(__file__).parent / "tiny_config.json").read_text()))
    ref_params = random_params(cfg, seed=3)
    kern_params = random_params(cfg, seed=3, kernels=KernelConfig(impl="pallas"))
    S, B, ctx = 4, 2, 11  # row 1 is padding
    cache = model.PagedKVCache.zeros(cfg, 9, 9, S, jnp.bfloat16)
    table = jnp.asarray([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]], jnp.int32)
    tables = model.PageTables(table, table, jnp.zeros((B,), jnp.int32))
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(B, ctx)), jnp.int32)
    pos = jnp.asarray(np.stack([np.arange(ctx), np.full(ctx, -1)]), jnp.int32)
    _, cache, _ = model.forward(ref_params, cache, prompt, pos, tables, cfg)
    toks = jnp.asarray([[7, 9, 11][:T], [0] * T], jnp.int32)
    step = (toks, jnp.asarray([list(range(ctx, ctx + T)), [-1] * T], jnp.int32), tables)
    calls = []
    spy = paged_attention.attention_new_token
    monkeypatch.setattr(paged_attention, "attention_new_token", lambda *a, **kw: calls.append(1) or spy(*a, **kw))
    want, want_cache, _ = model.forward(ref_params, cache, *step, cfg, KernelConfig(impl="reference"))
    assert not calls
    got, got_cache, _ = model.forward(kern_params, cache, *step, cfg, KernelConfig(impl="pallas"))
    assert len(calls) == cfg.num_layers
    a, b = np.asarray(got[0], np.float64), np.asarray(want[0], np.float64)
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2
    for name in ("k_sliding", "v_sliding", "k_full", "v_full"):
        new, old = np.asarray(getattr(got_cache, name), np.float32), np.asarray(getattr(cache, name), np.float32)
        ref = np.asarray(getattr(want_cache, name), np.float32)
        for p in range(ctx, ctx + T):
            slot = (slice(None), p // S + 1, p % S)  # page table[0][p // S], every layer
            assert (new[slot] != old[slot]).all(axis=-1).any()
            np.testing.assert_allclose(new[slot], ref[slot], rtol=2e-2, atol=2e-2)
            new[slot], ref[slot] = 0, 0
        np.testing.assert_array_equal(new[:, 1:], ref[:, 1:])  # nothing else written (page 0 is the null page)


def _fp8(pages_PSKH, rng, values=False):
    """The pages stored as an FP8 cache stores them (`kv_quant.quantize`, scales laid out `[P, K, S]`, `values`
    `[P, K, H, S]`), after giving each (slot, head) vector its own magnitude (1e-3 .. 1e3) so that a scale that is
    not per vector would show."""
    mag = 10.0 ** rng.uniform(-3, 3, size=pages_PSKH.shape[:-1] + (1,))
    pages, scale_PSK = kv_quant.quantize(jnp.asarray(np.asarray(pages_PSKH, np.float32) * mag, jnp.bfloat16))
    return kv_quant.values_PKHS(pages) if values else pages, kv_quant.scales_PKS(scale_PSK)


@pytest.mark.parametrize("window,S,ctxs,splits", [(FULL, 16, [1, 37, 200], 3), (128, 8, [5, 130, 300, 0], 2)])
def test_paged_decode_fp8_matches_reference(window, S, ctxs, splits):
    rng = np.random.default_rng(7)
    q, kp, vp, bt, pos, sinks = _case(len(ctxs) * 10 + S, len(ctxs), 16, 2, 64, S, ctxs, 1.0)
    (kp, ks), (vp, vs) = _fp8(kp, rng), _fp8(vp, rng, values=True)
    scales = dict(k_scale_PKS=ks, v_scale_PKS=vs)
    ref = attention_reference.attention(q, kp, vp, bt, pos, sinks, window, **scales)
    out = paged_attention.attention(
        q,
        kp,
        vp,
        bt,
        pos,
        sinks,
        window,
        **scales,
        block_kv=32,
        num_splits=splits,
        interpret=True,
    )
    # the stored values, dequantized, through the bf16 reference: the scales are applied where they belong
    deq = attention_reference.attention(
        q,
        *(
            kv_quant.dequantize(p, kv_quant.scales_PKS(s), jnp.bfloat16)
            for p, s in ((kp, ks), (kv_quant.values_PSKH(vp), vs))
        ),
        bt,
        pos,
        sinks,
        window,
    )
    out, ref, deq = (np.asarray(a, np.float64) for a in (out, ref, deq))
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2
    assert np.linalg.norm(ref - deq) / np.linalg.norm(deq) < 2e-2


@pytest.mark.parametrize("window,chunks", [(FULL, [(0, 21), (9, 5), (0, 0)]), (8, [(0, 21), (30, 13)])])
def test_prefill_flash_fp8_matches_reference(window, chunks):
    rng = np.random.default_rng(8)
    q, kp, vp, bt, pos, sinks = _prefill_case(len(chunks) + 4, 8, 2, 16, 4, chunks, 21, 1.0)
    (kp, ks), (vp, vs) = _fp8(kp, rng), _fp8(vp, rng, values=True)
    scales = dict(k_scale_PKS=ks, v_scale_PKS=vs)
    ref = attention_reference.attention(q, kp, vp, bt, pos, sinks, window, **scales)
    out = flash_attention.attention(q, kp, vp, bt, pos, sinks, window, **scales, block_q=16, block_kv=8, interpret=True)
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2


def test_new_token_attention_fp8_writes_and_attends_like_reference():
    """The new-token kernel on FP8 pools: it stores each fresh token's k and v with its scale as `kv_quant.quantize`
    does (the reference), leaves every other slot alone, and attends to the stored values."""
    rng = np.random.default_rng(9)
    N, K, H, S, window = 8, 2, 16, 4, FULL
    pos = np.array([0, 5, 17, 61, -1], np.int32)
    B, M = len(pos), 64 // S + 1
    P = B * M + 1
    (kp, ks), (vp, vs) = (_fp8(rng.normal(size=(2 * P, S, K, H)), rng, values=v) for v in (False, True))
    bt = rng.permutation(np.arange(1, P))[: B * M].reshape(B, M).astype(np.int32)
    wpage = np.where(pos >= 0, bt[np.arange(B), np.maximum(pos, 0) // S], 0)
    wslot = np.maximum(pos, 0) % S
    parts = tuple(jnp.asarray(rng.normal(size=(2, B, n * H)), jnp.float32) for n in (N, K, K))
    biases = tuple(jnp.asarray(rng.normal(size=(3, n * H)), jnp.bfloat16) for n in (N, K, K))
    angle = rng.uniform(0, 6.3, size=(B, H // 2))
    cos, sin = (jnp.asarray(f(angle), jnp.bfloat16) for f in (np.cos, np.sin))
    sinks = jnp.asarray(rng.normal(size=(3, N)), jnp.float32)
    args = (jnp.asarray(bt), P, jnp.asarray(pos), jnp.asarray(wpage), jnp.asarray(wslot), sinks, window)
    scales = dict(k_scale_PKS=ks, v_scale_PKS=vs)
    ref, *ref_pools = paged_attention.new_token_reference(parts, biases, 2, cos, sin, kp, vp, *args, **scales)
    out, got_k, got_v, done, got_ks, got_vs = paged_attention.attention_new_token(
        parts,
        biases,
        2,
        cos,
        sin,
        kp,
        vp,
        *args,
        **scales,
        block_kv=8,
        num_splits=2,
        interpret=True,
    )
    assert got_k.dtype == kv_quant.FP8 and got_ks.dtype == jnp.float32
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2
    keep = np.ones(2 * P, bool)
    keep[P] = False  # the null page of layer 1: the reference writes the padding row there, the kernel skips it
    for got, want, before in zip((got_k, got_v, got_ks, got_vs), ref_pools, (kp, vp, ks, vs)):
        got, want, before = (np.asarray(a, np.float32)[keep] for a in (got, want, before))
        assert (want != before).reshape(len(want), -1).any(axis=1).sum() == 4  # the four fresh rows' pages
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_sliding_layer_splits_only_the_blocks_its_window_covers():
    """Default splits, one row of 8 KV heads over a 512-page table of 16 keys (64-key blocks): a full layer takes
    the cap of 32, a sliding layer one split per block its window can cover (4 at 129 keys), where 32 would leave
    28 of them empty."""
    geometry = functools.partial(paged_attention._geometry, 1, 64, 16, 8, 512, 64, None, 512, 32)
    assert geometry()[3] == 32
    assert geometry(span=128 + 1)[3] == 4
    assert geometry(span=1000)[3] == 17
    assert geometry(span=4096)[3] == 32
