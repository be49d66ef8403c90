import dataclasses

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
    """Includes top_k 2,000: beyond the 1,024 candidates of the old `lax.top_k` path (which then sorted)."""
    rng = np.random.default_rng(V)
    B = 48
    logits = (rng.standard_normal((B, V)) * rng.uniform(0.1, 8, (B, 1))).astype(np.float32)
    temp = rng.choice([0.5, 1.0, 1.7], B).astype(np.float32)
    top_k = rng.choice([0, 1, 5, 50, 2000], B).astype(np.int32)
    top_p = rng.choice([1.0, 0.9, 0.5], B).astype(np.float32)
    min_p = rng.choice([0.0, 0.05, 0.3], B).astype(np.float32)
    f = jax.jit(sampling.sample)
    keys = jnp.stack([jax.random.PRNGKey(i) for i in range(B)])
    draws = np.stack(
        [
            np.asarray(
                f(
                    jnp.asarray(logits),
                    jax.vmap(jax.random.fold_in)(keys, jnp.full(B, r)),
                    jnp.asarray(temp),
                    jnp.asarray(top_k),
                    jnp.asarray(top_p),
                    jnp.asarray(min_p),
                )
            )
            for r in range(12)
        ],
        axis=1,
    )
    for b in range(B):
        allowed = _allowed(logits[b], temp[b], top_k[b], top_p[b], min_p[b])
        assert set(draws[b].tolist()) <= allowed, b
        if len(allowed) == 1:
            assert set(draws[b].tolist()) == allowed


def test_draw_frequencies_follow_the_distribution():
    logits = np.log(np.array([[0.5, 0.3, 0.2, 1e-9]], np.float32))
    f = jax.jit(
        jax.vmap(
            lambda k: sampling.sample(
                jnp.asarray(logits), k[None], jnp.ones(1), jnp.zeros(1, jnp.int32), jnp.ones(1), jnp.zeros(1)
            )[0]
        )
    )
    draws = np.asarray(f(jax.random.split(jax.random.PRNGKey(0), 4000)))
    freq = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(freq[:3], [0.5, 0.3, 0.2], atol=0.03)


def test_draws_across_draw_blocks_follow_the_distribution():
    """Mass spread over several `DRAW_BLOCK`s of a vocabulary that is not a multiple of it, with
    temperature only (the path that skips the candidates)."""
    V = 3 * sampling.DRAW_BLOCK + 77
    where, probs = (
        [5, sampling.DRAW_BLOCK + 3, 3 * sampling.DRAW_BLOCK + 76, 2 * sampling.DRAW_BLOCK],
        [0.4, 0.3, 0.2, 0.1],
    )
    logits = np.full((1, V), -1e9, np.float32)
    logits[0, where] = np.log(probs)
    f = jax.jit(
        jax.vmap(
            lambda k: sampling.sample(
                jnp.asarray(logits), k[None], jnp.ones(1), jnp.zeros(1, jnp.int32), jnp.ones(1), jnp.zeros(1)
            )[0]
        )
    )
    draws = np.asarray(f(jax.random.split(jax.random.PRNGKey(1), 4000)))
    assert set(draws.tolist()) <= set(where)
    freq = np.array([np.mean(draws == t) for t in where])
    np.testing.assert_allclose(freq, probs, atol=0.03)


def test_greedy_rows_beside_filtered_rows():
    """Temperature-0 rows take the argmax whatever their filters, in a batch that runs the search."""
    rng = np.random.default_rng(3)
    B, V = 8, 2000
    logits = jnp.asarray(rng.standard_normal((B, V)).astype(np.float32))
    temp = jnp.asarray([0.0, 1.0] * 4, jnp.float32)
    top_k = jnp.asarray([5, 5, 0, 0, 1500, 1500, 1, 1], jnp.int32)
    top_p = jnp.asarray([1.0, 1.0, 0.5, 0.5, 0.9, 0.9, 1e-6, 1e-6], jnp.float32)
    keys = jnp.stack([jax.random.PRNGKey(i) for i in range(B)])
    draws = np.asarray(jax.jit(sampling.sample)(logits, keys, temp, top_k, top_p, jnp.zeros(B)))
    greedy = np.asarray(jnp.argmax(logits, axis=-1))
    np.testing.assert_array_equal(draws[::2], greedy[::2])
    assert draws[7] == greedy[7]  # top_k 1 on a sampled row


def test_max_argmax_matches_jnp():
    """The one-pass maximum and argmax: ties to the lowest index, +inf, and rows of -inf only."""
    rng = np.random.default_rng(5)
    x = np.round(rng.standard_normal((6, 3000)) * 2).astype(np.float32)  # many ties at the top
    x[1, 2999] = x[1].max() + 1  # maximum in the last column
    x[2] = -np.inf
    x[3, ::5] = np.inf
    x[4, :] = x[4, 0]
    got_max, got_id = jax.jit(sampling._max_argmax)(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(got_id), np.argmax(x, axis=-1))
    np.testing.assert_array_equal(np.asarray(got_max), x.max(axis=-1))


def _reference_threshold(s, top_k, top_p, margin=1e-5):
    """Sort-based top-k / top-p threshold of one row of scaled logits, in float64: `(lo, hi)`, the
    thresholds for `top_p + margin` and `top_p - margin`. They are equal unless an exclusive cumulative
    sum lies within `margin` of top_p; there f32 sums in any order (the old cumulative sum as much as the
    new search) may decide either way, and anything between is right. -inf: keep all."""
    V = len(s)
    d = np.sort(s.astype(np.float64))[::-1]
    t_k = d[top_k - 1] if 0 < top_k < V else -np.inf
    if top_p >= 1:
        return (t_k, t_k)
    p = np.exp(d - d[0])
    p /= p.sum()
    excl = np.cumsum(p) - p
    out = []
    for q in (top_p + margin, top_p - margin):
        kept = max(1, int(np.sum(excl < q)))
        out.append(max(t_k, d[kept - 1]))
    return tuple(out)


def _keep_all_as_inf(t, row):
    """A threshold at or below the row's minimum keeps the whole row, as -inf does."""
    return -np.inf if t <= row.min() else float(t)


def _check_thresholds(scaled, top_k, top_p, min_decisive=0.8):
    t = np.asarray(jax.jit(sampling._rank_threshold)(jnp.asarray(scaled), jnp.asarray(top_k), jnp.asarray(top_p)))
    decisive = 0
    for b in range(len(scaled)):
        lo, hi = (_keep_all_as_inf(x, scaled[b]) for x in _reference_threshold(scaled[b], top_k[b], top_p[b]))
        got = _keep_all_as_inf(t[b], scaled[b])
        decisive += lo == hi
        assert lo <= got <= hi, (b, top_k[b], top_p[b], got, lo, hi, np.sum(scaled[b] >= got), np.sum(scaled[b] >= lo))
    assert decisive >= min_decisive * len(scaled), decisive  # the comparison keeps its teeth
    return t


def _mixed_rows(rng, B, V):
    """Rows of many shapes: gaussian at scales from very flat to very peaked, coarse grids full of ties
    (and of +0.0 / -0.0), and rows with -inf entries."""
    scale = rng.choice([1e-3, 0.05, 1.0, 4.0, 30.0], (B, 1))
    logits = rng.standard_normal((B, V)) * scale
    grid = rng.random(B) < 0.3
    logits[grid] = np.round(logits[grid] / scale[grid] * 2) / 2  # steps of 0.5: hundreds of ties each
    neg_inf = rng.random(B) < 0.3
    logits[neg_inf] = np.where(rng.random((neg_inf.sum(), V)) < 0.4, -np.inf, logits[neg_inf])
    logits = logits.astype(np.float32)
    zeros = logits == 0
    logits[zeros] = np.where(rng.random(zeros.sum()) < 0.5, np.float32(-0.0), np.float32(0.0))
    return logits


@pytest.mark.parametrize("V", [1000, 4999])
@pytest.mark.parametrize("filters", ["both", "top_k", "top_p"])
def test_rank_threshold_matches_sorted_reference(V, filters):
    """Exact against a full sort for every k and nucleus width, including nuclei far wider than the
    1,024 candidates of the old `lax.top_k` path, ties, -inf and signed zeros."""
    rng = np.random.default_rng(V + len(filters))
    B = 120
    logits = _mixed_rows(rng, B, V)
    temp = rng.choice([0.5, 1.0, 2.0], (B, 1)).astype(np.float32)
    scaled = np.asarray(jnp.asarray(logits) / jnp.asarray(temp))
    top_k = rng.choice([0, 1, 5, V - 1, V], B).astype(np.int32)
    top_p = rng.choice([1.0, 0.9, 0.5, 1e-6], B).astype(np.float32)
    if filters == "top_k":
        top_p[:] = 1.0
    elif filters == "top_p":
        top_k[:] = 0
    t = _check_thresholds(scaled, top_k, top_p)
    kept = (scaled >= t[:, None]).sum(-1)
    if filters != "top_k" and V > 1024:
        assert kept[top_p == 0.9].max() > 1024  # some nucleus wider than the old candidates


def test_rank_threshold_ties_and_signed_zeros():
    """Ties at the threshold are all kept, by either filter; -0.0 and +0.0 tie; -inf tokens rank last."""
    probs = np.array([0.3, 0.2, 0.2, 0.2, 0.1], np.float32)
    row = np.concatenate([np.log(probs), [-np.inf, -np.inf]]).astype(np.float32)
    zeros = np.array([0.0, -1.0, -0.0, 1.0, -np.inf, -0.0, -2.0], np.float32)
    cases = [  # row, top_k, top_p, tokens kept
        (row, 1, 1.0, 1),
        (row, 2, 1.0, 4),
        (row, 4, 1.0, 4),
        (row, 5, 1.0, 5),
        (row, 6, 1.0, 7),
        (row, 0, 0.25, 1),
        (row, 0, 0.4, 4),
        (row, 0, 0.75, 4),
        (row, 0, 0.95, 5),
        (row, 2, 0.25, 1),
        (row, 1, 0.4, 1),
        (row, 3, 0.6, 4),
        (row, 0, 1e-6, 1),
        (zeros, 1, 1.0, 1),
        (zeros, 2, 1.0, 4),
        (zeros, 3, 1.0, 4),
        (zeros, 4, 1.0, 4),
        (zeros, 5, 1.0, 5),
        (zeros, 6, 1.0, 6),
        (zeros, 7, 1.0, 7),
        (zeros, 0, 0.5, 4),
    ]
    scaled = np.stack([c[0] for c in cases])
    top_k = np.array([c[1] for c in cases], np.int32)
    top_p = np.array([c[2] for c in cases], np.float32)
    t = _check_thresholds(scaled, top_k, top_p, min_decisive=1.0)
    assert (scaled >= t[:, None]).sum(-1).tolist() == [c[3] for c in cases]


def test_rank_threshold_full_vocabulary():
    """gpt-oss's vocabulary: peaked rows and flat ones (a nucleus of ~180k tokens, whose mass steps of
    ~5e-6 a token put a few tokens within rounding of top_p: the one row not compared exactly). The seed
    leaves the peaked top-p row clear of such near-ties."""
    V = 201_088
    rng = np.random.default_rng(8)
    scaled = (rng.standard_normal((4, V)) * np.array([[4.0], [4.0], [0.05], [0.05]])).astype(np.float32)
    top_k = np.array([50, 0, 0, 150_000], np.int32)
    top_p = np.array([0.9, 0.9, 0.9, 1.0], np.float32)
    t = _check_thresholds(scaled, top_k, top_p, min_decisive=0.75)
    assert (scaled[2] >= t[2]).sum() > 100_000


@pytest.mark.parametrize("k", [1, 20, 64])
def test_top_k_matches_lax_top_k(k):
    """The argmax-pass top-k (used for log-probabilities) returns what `lax.top_k` does: values descending,
    tied values by lower id, -inf entries last, and k equal to the row length."""
    rng = np.random.default_rng(k)
    x = rng.standard_normal((4, 500)).astype(np.float32)
    x[0, ::7] = 1.5  # a tie across the top
    x[1, 3:] = -np.inf  # fewer finite values than k
    x[2] = np.round(x[2], 1)  # many small ties
    got_v, got_i = jax.jit(sampling.top_k, static_argnums=1)(jnp.asarray(x), k)
    want_v, want_i = jax.lax.top_k(jnp.asarray(x), k)
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    whole_v, whole_i = sampling.top_k(jnp.asarray(x[:, :k]), k)
    np.testing.assert_array_equal(np.asarray(whole_i), np.asarray(jax.lax.top_k(jnp.asarray(x[:, :k]), k)[1]))


def _batch(B, proc, penalties):
    z = np.zeros(B, np.float32)
    return sampling.SamplingBatch(
        jnp.asarray(z),
        jnp.zeros(B, jnp.int32),
        jnp.ones(B, jnp.float32),
        jnp.asarray(z),
        jnp.zeros((B, 2), jnp.uint32),
        jnp.zeros(B, bool),
        jnp.zeros(B, bool),  # no structured-output mask (unused by the processors)
        jnp.zeros((B, 1), jnp.int32),
        jnp.zeros(B, jnp.int32),
        jnp.zeros(B, bool),
        jnp.asarray(penalties, jnp.float32),
        jnp.asarray(proc, jnp.int32),
    )


def test_processors_match_numpy():
    """`apply_penalties_and_bias` row by row against the definitions, each row with its own mix of processors."""
    rng = np.random.default_rng(0)
    B, V, S = 6, 64, 8
    L = sampling.MAX_BAD_WORD_TOKENS
    logits = rng.standard_normal((B, V)).astype(np.float32) * 3
    counts = rng.integers(0, 3, (S, V)).astype(np.uint16) | (rng.random((S, V)) < 0.2).astype(np.uint16) << 15
    recent = rng.integers(0, V, (S, L)).astype(np.int32)
    lists = sampling.empty_lists(S, V)
    slot = np.array([3, 0, 5, 1, 7, 2])
    pos = np.array([20, 11, 30, 9, 15, 13])
    prompt_len = np.array([10, 10, 25, 5, 12, 12])
    flags = np.array([1, 2, 4, 8, 16, 31])
    min_tokens = np.array([0, 0, 0, 0, 50, 2])
    penalties = np.tile([0.0, 0.0, 1.0], (B, 1)).astype(np.float32)
    penalties[[0, 5]] = [[0.5, 0.3, 1.4], [-0.4, 1.1, 0.7]]
    for b in range(B):
        s = slot[b]
        lists.bias_ids_BN[s, :3], lists.bias_BN[s, :3] = rng.choice(V, 3, replace=False), [5.0, -7.0, 100.0]
        lists.allowed_BA[s, :5] = rng.choice(V, 5, replace=False)
        lists.stops_BK[s, :2] = rng.choice(V, 2, replace=False)
        at = (pos[b] - np.arange(L - 2, -1, -1)) % L  # the last L - 1 positions' columns
        lists.bad_BWL[s, 0, -1] = 1  # one token
        lists.bad_BWL[s, 1, -2:] = [recent[s, at[-1]], 2]  # matches the last token: bans 2
        lists.bad_BWL[s, 2, -3:] = [recent[s, at[-2]] + 1, recent[s, at[-1]], 3]  # mismatch: 3 stays
    state = sampling.SamplerState.zeros(S, V).replace(
        counts_SV=jnp.asarray(counts), recent_SR=jnp.asarray(recent), lists=jax.tree.map(jnp.asarray, lists)
    )
    proc = np.stack([flags, min_tokens, prompt_len, slot], 1)
    got = np.asarray(
        jax.jit(sampling.apply_penalties_and_bias)(
            jnp.asarray(logits), jnp.asarray(pos), _batch(B, proc, penalties), state
        )
    )
    for b in range(B):
        s, x = slot[b], logits[b].copy()
        if flags[b] & sampling.USES_ALLOWED:
            x[~np.isin(np.arange(V), lists.allowed_BA[s])] = -np.inf
        if flags[b] & sampling.USES_BAD_WORDS:
            x[[1, 2]] = -np.inf
        if flags[b] & sampling.USES_MIN_TOKENS and pos[b] + 1 - prompt_len[b] < min_tokens[b]:
            x[lists.stops_BK[s, :2]] = -np.inf
        if flags[b] & sampling.USES_BIAS:
            x[lists.bias_ids_BN[s, :3]] += lists.bias_BN[s, :3]
        if flags[b] & sampling.USES_PENALTIES:
            n = (counts[s] & 0x7FFF).astype(np.float32)
            seen = (n > 0) | (counts[s] >> 15 > 0)
            pres, freq, rep = penalties[b]
            x = np.where(seen, np.where(x > 0, x / rep, x * rep), x) - freq * n - pres * (n > 0)
        np.testing.assert_allclose(got[b], x, rtol=1e-6, err_msg=str(b))
    assert np.isneginf(got[3, 2]) and not np.isneginf(got[3, 3])  # bad words: the matching prefix only
    assert np.isfinite(got[2]).sum() == 5  # allowed ids only


def test_recorded_counts_and_recent_tokens_match_the_sequence():
    """`record_prefill` over chunks (a recomputed sequence: prompt then generated tokens) and `record_input` per
    decode step leave the slot's counts = the generated tokens' counts, the prompt's tokens flagged, and the last
    positions' tokens in `recent_SR`; a chunk at position 0 clears what a slot's earlier sequence left."""
    rng = np.random.default_rng(1)
    V, S, T = 40, 4, 8
    L = sampling.MAX_BAD_WORD_TOKENS
    tokens = rng.integers(0, V, 30).tolist()
    prompt_len, slot = 11, 2
    state = sampling.SamplerState.zeros(S, V)
    state = dataclasses.replace(state, counts_SV=state.counts_SV.at[slot].set(7))  # a previous sequence's
    proc = np.array([[sampling.USES_PENALTIES, 0, prompt_len, slot]])
    sb = _batch(1, proc, [[0.0, 1.0, 1.0]])
    prefill, decode = jax.jit(sampling.record_prefill), jax.jit(sampling.record_input)
    for start in range(0, 20, T):  # chunks of the first 20 tokens (9 of them generated)
        chunk = np.zeros((1, T), np.int32)
        positions = np.full((1, T), -1, np.int32)
        n = min(T, 20 - start)
        chunk[0, :n], positions[0, :n] = tokens[start : start + n], np.arange(start, start + n)
        lists = jax.tree.map(jnp.asarray, sampling.empty_lists(1, V))
        state = prefill(state, sb, lists, jnp.asarray(chunk), jnp.asarray(positions), jnp.asarray([n - 1]))
    for p in range(20, 30):
        state = decode(state, sb, jnp.asarray([tokens[p]]), jnp.asarray([p]))
    counts = np.asarray(state.counts_SV[slot])
    want = np.bincount(tokens[prompt_len:], minlength=V)
    np.testing.assert_array_equal(counts & 0x7FFF, want)
    np.testing.assert_array_equal(counts >> 15, np.isin(np.arange(V), tokens[:prompt_len]))
    recent = np.asarray(state.recent_SR[slot])
    assert [recent[p % L] for p in range(30 - L, 30)] == tokens[30 - L :]
    assert int(np.asarray(state.counts_SV)[0].sum()) == 0  # other slots untouched


@pytest.mark.parametrize("mix", ["greedy", "plain", "filtered", "everything"])
def test_branchless_sampler_equals_the_shortcuts_and_has_no_conditional(mix):
    """`sample_batch(branchless=True)` (the prefill calls', whose conditionals would hold the host until the forward
    pass is done) draws the same tokens and log-probabilities as the shortcut version for batches that skip every
    shortcut, some, or none, and lowers without a conditional."""
    rng = np.random.default_rng(3)
    B, V, S = 5, 300, 8
    logits = jnp.asarray(rng.standard_normal((B, V)) * 3, jnp.float32)
    temp = {"greedy": 0.0, "plain": 0.8}.get(mix, 1.0)
    top_k = np.array([0, 5, 0, 40, 0]) if mix in ("filtered", "everything") else np.zeros(B, int)
    top_p = np.array([1, 1, 0.7, 0.9, 1]) if mix in ("filtered", "everything") else np.ones(B)
    everything = mix == "everything"
    proc = np.array([[sampling.USES_PENALTIES * everything, 0, 3, s] for s in range(B)])
    masked = np.array([everything, False, everything, False, False])
    mask = rng.integers(-(2**31), 2**31, (B, -(-V // 32)), dtype=np.int64).astype(np.int32)
    sb = sampling.SamplingBatch(
        jnp.full(B, temp, jnp.float32),
        jnp.asarray(top_k, jnp.int32),
        jnp.asarray(top_p, jnp.float32),
        jnp.zeros(B, jnp.float32),
        jnp.asarray(rng.integers(0, 2**31, (B, 2)), jnp.uint32),
        jnp.asarray([everything] + [False] * (B - 1)),
        jnp.asarray(masked),
        jnp.asarray(mask),
        jnp.zeros(B, jnp.int32),
        jnp.zeros(B, bool),
        jnp.tile(jnp.asarray([0.3, 0.2, 1.2], jnp.float32), (B, 1)),
        jnp.asarray(proc, jnp.int32),
    )
    counts = jnp.asarray(rng.integers(0, 3, (S, V)), jnp.uint16)
    state = sampling.SamplerState.zeros(S, V).replace(counts_SV=counts)
    pos = jnp.arange(B, dtype=jnp.int32) + 10

    def run(branchless):
        return jax.jit(lambda *a: sampling.sample_batch(*a, 4, state, branchless))(logits, pos, sb)

    shortcuts, branchless = run(False), run(True)
    for a, b in zip(jax.tree.leaves(shortcuts), jax.tree.leaves(branchless)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    text = jax.jit(lambda *a: sampling.sample_batch(*a, 4, state, True)).lower(logits, pos, sb).as_text()
    assert "stablehlo.case" not in text and "stablehlo.if" not in text
    assert "stablehlo.case" in jax.jit(lambda *a: sampling.sample_batch(*a, 4, state)).lower(logits, pos, sb).as_text()
