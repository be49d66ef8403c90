"""Speculative decoding on the tiny fp32 model: greedy outputs token-identical with and without speculation for every
drafter (n-gram, random proposals, the oracle at full, no and partial acceptance) under continuous batching,
preemption and prefix caching, single- and multi-step; exact rejection sampling (chi-square against the target's
distribution); the acceptance counters in the engine stats and `/metrics`; config errors."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gptoss_jax import cli, engine_config, serve, speculative, steps
from gptoss_jax.async_engine import stats_dict
from gptoss_jax.config import ConfigError
from gptoss_jax.engine import Engine
from gptoss_jax.llm import LLM
from gptoss_jax.sampling import SamplingBatch, SamplingParams
from gptoss_jax.server.metrics import PREFIX, Metrics

# 4-token pages and 13 full pages (48 tokens) so that the requests below preempt each other; one decode bucket, so
# each engine compiles one decode program; two steps per decode call (the engines share their prefill programs).
SMALL = dict(
    page_size=4,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    prefill_chunk_size=8,
    max_prefill_seqs=2,
    num_pages=13,
    max_model_len=40,
    min_context_bucket=256,
    max_logprobs=3,
    decode_batch_buckets=(4,),
    decode_steps_per_call=2,
)


def greedy(n, **kw):
    return SamplingParams(**{"temperature": 0, "max_tokens": n, "stop_token_ids": [], **kw})


def run(engine, requests):
    """requests: {id: (prompt, params)} -> {id: (tokens, finish_reason, logprobs)}; all added at once."""
    for rid, (prompt, sp) in requests.items():
        engine.add_request(rid, prompt, sp)
    out = {rid: [] for rid in requests}
    lps = {rid: [] for rid in requests}
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            lps[o.request_id] += o.logprobs or []
            if o.finished:
                done[o.request_id] = (out[o.request_id], o.finish_reason, lps[o.request_id])
    return done


def _requests():
    rng = np.random.default_rng(0)
    shared = rng.integers(2, 512, size=9).tolist()  # a prefix two prompts share (prefix caching)
    prompts = [rng.integers(2, 512, size=int(n)).tolist() for n in (3, 17, 6, 11)]
    prompts += [shared + [7, 8], shared + [9]]
    # a repetitive prompt, where the n-gram drafter finds matches
    prompts.append([5, 6, 7, 8] * 3)
    reqs = {f"r{i}": (p, greedy(4 + 3 * i)) for i, p in enumerate(prompts)}
    reqs["r1"] = (reqs["r1"][0], greedy(9, logprobs=2))
    # a row with a logits processor: it does not draft, in the same batch as rows that do
    reqs["r2"] = (reqs["r2"][0], greedy(12, repetition_penalty=1.3))
    return reqs


REQUESTS = _requests()


@pytest.fixture(scope="module")
def baseline(small_checkpoint):
    engine = Engine(small_checkpoint, dtype="float32", progress=False, **SMALL)
    return run(engine, REQUESTS)


def _spec_engine(small_checkpoint, spec, **kw):
    return Engine(small_checkpoint, dtype="float32", progress=False, speculative_config=spec, **{**SMALL, **kw})


def _same(got, want):
    for rid, (tokens, reason, lps) in want.items():
        assert got[rid][:2] == (tokens, reason), rid
        assert len(got[rid][2]) == len(lps), rid
        for (lp, top), (lp2, top2) in zip(lps, got[rid][2]):
            assert lp2 == pytest.approx(lp, abs=1e-4) and [t for t, _ in top2] == [t for t, _ in top], rid


def _oracle(baseline, length, k=3):
    conts = [p + baseline[rid][0] for rid, (p, _) in REQUESTS.items()]
    return dict(method="oracle", num_speculative_tokens=k, acceptance_length=length, continuations=conts)


NGRAM = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)


@pytest.fixture(scope="module")
def ngram_engine(small_checkpoint):
    """Warmed up: serving compiles nothing. No prefix caching (the sampled test repeats a path exactly)."""
    return _spec_engine(small_checkpoint, NGRAM, warmup=True, enable_prefix_caching=False)


def _check_counters(st, k, name):
    assert st.num_running == st.num_waiting == 0
    assert st.spec_decode_num_draft_tokens == k * st.spec_decode_num_drafts > 0
    assert sum(st.spec_decode_num_accepted_tokens_per_pos) == st.spec_decode_num_accepted_tokens
    per_step = 1 + st.spec_decode_num_accepted_tokens / st.spec_decode_num_drafts
    if name == "oracle_none":
        assert st.spec_decode_num_accepted_tokens == 0
    if name == "oracle_all":  # every draft of the known continuation, short of the requests' ends
        assert per_step > 2.5
    if name == "oracle_partial":  # 1 or 2 drafts per step (2.5 tokens), fewer at the requests' ends
        assert 1.8 < per_step < 2.9 and st.spec_decode_num_accepted_tokens_per_pos[2] == 0
    if name == "ngram":  # the repetitive prompt's continuation is found
        assert st.spec_decode_num_accepted_tokens > 0


def test_ngram_greedy_outputs_identical_and_nothing_compiles(ngram_engine, baseline):
    with steps.compilations() as seen:
        got = run(ngram_engine, REQUESTS)
    assert seen == []
    _same(got, baseline)
    assert ngram_engine.stats().num_preemptions > 0
    _check_counters(ngram_engine.stats(), 3, "ngram")


@pytest.mark.parametrize(
    "name,steps_per_call",
    # the oracle's acceptance length is a device value: its three engines share one compiled decode step
    [("oracle_partial", 2), ("oracle_all", 2), ("oracle_none", 2), pytest.param("random", 1, marks=pytest.mark.slow)],
)
def test_greedy_outputs_identical_with_any_drafter(small_checkpoint, baseline, name, steps_per_call):
    spec = {
        "random": dict(method="random", num_speculative_tokens=2),
        "oracle_all": _oracle(baseline, 4.0),
        "oracle_none": _oracle(baseline, 1.0),
        "oracle_partial": _oracle(baseline, 2.5),
    }[name]
    # one of them without async scheduling: each call read before the next is built
    engine = _spec_engine(
        small_checkpoint, spec, decode_steps_per_call=steps_per_call, async_scheduling=name != "oracle_none"
    )
    got = run(engine, REQUESTS)
    _same(got, baseline)
    # and again for the prompts with a shared prefix, now in the prefix cache
    shared = {rid: REQUESTS[rid] for rid in ("r4", "r5")}
    _same(run(engine, shared), {rid: baseline[rid] for rid in shared})
    assert engine.stats().num_preemptions > 0
    _check_counters(engine.stats(), spec["num_speculative_tokens"], name)


def _run_counting(engine, requests, later):
    """`run` one step at a time, adding `later`'s requests once a call has counted drafts -> (results, per step:
    (requests enqueued when its decode call launched, drafts that call counted)). A call is read in the step that
    launches it, or with async scheduling in the next."""
    ids = {**requests, **later}
    out, lps, done, seen = {rid: [] for rid in ids}, {rid: [] for rid in ids}, {}, []
    for rid, (prompt, sp) in requests.items():
        engine.add_request(rid, prompt, sp)
    while engine.has_unfinished_requests():
        st = engine.stats()
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            lps[o.request_id] += o.logprobs or []
            if o.finished:
                done[o.request_id] = (out[o.request_id], o.finish_reason, lps[o.request_id])
        seen.append(
            (st.num_running + st.num_waiting, engine.stats().spec_decode_num_drafts - st.spec_decode_num_drafts)
        )
        if later and engine.stats().spec_decode_num_drafts:
            for rid, (prompt, sp) in later.items():
                engine.add_request(rid, prompt, sp)
            later = {}
    lag = int(engine.config.async_scheduling)
    return done, [(enqueued, drafts) for (enqueued, _), (_, drafts) in zip(seen, seen[lag:] + [(0, 0)] * lag)]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_drafting_stops_while_more_requests_are_enqueued_than_disable_by_batch_size(
    small_checkpoint, baseline, async_scheduling
):
    """vLLM's `disable_by_batch_size`: a decode call drafts only while at most that many requests are enqueued
    (running + waiting), whatever its rows. Three requests draft; four more added mid-run stop the drafting (calls of
    one to four rows) until enough have finished, then it resumes. Greedy outputs stay the target's through the
    switches (both programs of a bucket keep the same device state), only drafting calls count, and serving
    compiles nothing: warm-up made both programs."""
    limit = 3
    spec = {**_oracle(baseline, 2.5), "disable_by_batch_size": limit}
    engine = _spec_engine(small_checkpoint, spec, warmup=True, async_scheduling=async_scheduling)
    assert sorted(k[3] for k in engine.runner.buckets() if k[0] == "decode") == [False, False, True, True]
    first = {rid: REQUESTS[rid] for rid in ("r4", "r5", "r6")}
    later = {rid: REQUESTS[rid] for rid in ("r0", "r1", "r2", "r3")}
    with steps.compilations() as seen:
        got, calls = _run_counting(engine, first, later)
    assert seen == []
    _same(got, baseline)
    over = [i for i, (enqueued, _) in enumerate(calls) if enqueued > limit]
    assert over and all(calls[i][1] == 0 for i in over)  # no drafts while 7 .. 4 are enqueued
    assert any(d for _, d in calls[: over[0]]) and any(d for _, d in calls[over[-1] + 1 :])  # before and after
    assert engine.stats().num_preemptions > 0


def test_the_drafting_decision_counts_waiting_requests(small_checkpoint, baseline):
    """Eight requests and `disable_by_batch_size` 4: calls of four rows or fewer (`max_num_seqs` 4) while the rest
    wait do not draft and count nothing; once the waiting ones are aborted, the running ones draft."""
    spec = {**_oracle(baseline, 4.0), "disable_by_batch_size": 4}
    engine = _spec_engine(small_checkpoint, spec, async_scheduling=False)
    reqs, want = {**REQUESTS, "r7": REQUESTS["r6"]}, {**baseline, "r7": baseline["r6"]}
    for rid, (prompt, sp) in reqs.items():
        engine.add_request(rid, prompt, sp)
    out, done = {rid: [] for rid in reqs}, {}
    pending, launched = [], engine.scheduler.launched

    def record(work, drafts=True):  # what the scheduler counts in flight for each row of a decode call
        launched(work, drafts)
        pending.extend((drafts, s.num_pending) for s in work.decodes)

    engine.scheduler.launched = record

    def step():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            if o.finished and o.finish_reason != "abort":
                done[o.request_id] = (out[o.request_id], o.finish_reason, [])

    while sum(max(0, len(t) - 1) for t in out.values()) < 8:  # tokens past the prefills' first: decode calls ran
        st = engine.stats()
        assert st.num_running <= 4 < st.num_running + st.num_waiting
        step()
    st = engine.stats()
    assert st.spec_decode_num_drafts == 0 and st.num_waiting > 0
    # a call that does not draft gives one token per step, and its rows are reserved that much, not k + 1 a step
    steps = engine.config.decode_steps_per_call
    assert pending and all(d is False and n == steps for d, n in pending), pending
    waiting = [seq.request_id for seq in engine.scheduler.waiting]
    for rid in waiting:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        step()
    assert engine.stats().spec_decode_num_drafts > 0
    assert set(done) == set(reqs) - set(waiting)
    _same(done, {rid: (*want[rid][:2], []) for rid in done})


@pytest.mark.parametrize("limit,drafting", [(None, [1, 2, 4]), (2, [1, 2]), (3, [1, 2, 4])])
def test_decode_programs_under_disable_by_batch_size(small_checkpoint, limit, drafting):
    """Without a limit a speculative engine has one (drafting) decode program per bucket, as many as without
    speculation; with one, every bucket also has the non-drafting program, and the drafting one only where a call can
    hold `limit` sequences or fewer (3 sequences take the bucket of 4)."""
    kw = dict(decode_batch_buckets=(1, 2, 4))
    plain = Engine(small_checkpoint, dtype="float32", progress=False, **{**SMALL, **kw}).runner.buckets()
    decode = [k for k in plain if k[0] == "decode"]
    twice = lambda rows: sorted(rows * 2)  # noqa: E731 - each bucket also has its program for greedy calls
    assert sorted(k[1] for k in decode) == twice([1, 2, 4]) and not any(k[3] for k in decode)
    engine = _spec_engine(small_checkpoint, {**NGRAM, "disable_by_batch_size": limit}, **kw)
    buckets = engine.runner.buckets()
    assert [k for k in buckets if k[0] == "prefill"] == [k for k in plain if k[0] == "prefill"]
    decode = [k for k in buckets if k[0] == "decode"]
    assert sorted(k[1] for k in decode if k[3]) == twice(drafting)
    assert sorted(k[1] for k in decode if not k[3]) == ([] if limit is None else twice([1, 2, 4]))
    assert {engine.runner._st(k).draft for k in decode} == ({True} if limit is None else {True, False})
    assert all(engine.runner._st(k).draft == k[3] and engine.runner._st(k).plain == k[4] for k in decode)


def test_sampled_outputs_are_reproducible(ngram_engine):
    """Seeded sampled requests repeat exactly along the same path. (Which tokens a seed gives depends on the drafts
    and on where the first token is drawn: a prompt whose last chunk is cached starts in prefill, not in a verify
    step; the distribution is the target's either way.)"""
    sp = SamplingParams(temperature=1.0, top_k=20, max_tokens=12, seed=7, stop_token_ids=[])
    reqs = {f"s{i}": (p, sp) for i, (p, _) in enumerate(list(REQUESTS.values())[:3])}
    first, second = run(ngram_engine, reqs), run(ngram_engine, reqs)
    assert first == second
    for tokens, reason, _ in first.values():
        assert len(tokens) == 12 and reason == "length" and all(0 <= t < 512 for t in tokens)


def _sampling(B, temperature, top_k=0):
    return SamplingBatch(
        temperature_B=jnp.full(B, temperature, jnp.float32),
        top_k_B=jnp.full(B, top_k, jnp.int32),
        top_p_B=jnp.ones(B, jnp.float32),
        min_p_B=jnp.zeros(B, jnp.float32),
        keys_B2=jnp.stack([jnp.zeros(B, jnp.uint32), jnp.arange(B, dtype=jnp.uint32)], 1),
        want_logprobs_B=jnp.zeros(B, bool),
        masked_B=jnp.zeros(B, bool),
        mask_BW=jnp.zeros((B, 1), jnp.int32),
        mask_pos_B=jnp.zeros(B, jnp.int32),
        holds_B=jnp.zeros(B, bool),
        penalties_B3=jnp.zeros((B, 3), jnp.float32),
        proc_B4=jnp.zeros((B, 4), jnp.int32),
    )


# chi-square critical values at p = 1e-4 (false alarm once in 10,000 runs) by degrees of freedom
CHI2_CRITICAL = {5: 25.74, 6: 27.86, 7: 29.88}


def _chi2(samples, p):
    counts = np.bincount(samples, minlength=len(p))
    keep = p > 0
    assert counts[~keep].sum() == 0, "a token outside the target's support"
    expected = p[keep] * len(samples)
    return float(np.sum((counts[keep] - expected) ** 2 / expected)), int(keep.sum() - 1)


@pytest.mark.parametrize("drafter", ["sampled", "deterministic"])
def test_rejection_sampling_matches_the_target_distribution(drafter):
    """Rows that differ only in their PRNG keys: the first token of each step follows the target's distribution p
    (after temperature and top-k), whatever the drafts and their q; so does the second, given the first draft was
    accepted."""
    B, V, k = 40000, 8, 2
    rng = np.random.default_rng(0)
    logits = np.tile(rng.normal(0, 1.5, size=(1, k + 1, V)).astype(np.float32), (B, 1, 1))
    temperature, top_k = 0.8, 6
    q = np.array([0.3, 0.05, 0.05, 0.1, 0.2, 0.1, 0.15, 0.05], np.float32)  # differs from p
    if drafter == "sampled":
        d = rng.choice(V, size=(B, k), p=q).astype(np.int32)
        draft = speculative.Draft(jnp.asarray(d), jnp.asarray(np.broadcast_to(q, (B, k, V))))
    else:  # one fixed proposal (q one-hot), as the n-gram drafter's
        d = np.full((B, k), int(np.argsort(logits[0, 0])[-2]), np.int32)
        draft = speculative.Draft(jnp.asarray(d))
    sb = _sampling(B, temperature, top_k)
    out, n = jax.jit(speculative.verify)(
        jnp.asarray(logits), draft, jnp.ones(B, bool), jnp.zeros(B, jnp.int32), jnp.zeros(B, jnp.int32), sb
    )
    out, n = np.asarray(out), np.asarray(n)
    p = np.asarray(
        speculative.sampling.filtered_probs(
            jnp.asarray(logits[0]),
            jnp.full(k + 1, temperature),
            jnp.full(k + 1, top_k, jnp.int32),
            jnp.ones(k + 1),
            jnp.zeros(k + 1),
        )
    ).astype(np.float64)
    assert 0.05 < np.mean(n > 0) < 0.95  # both outcomes happen often
    stat, df = _chi2(out[:, 0], p[0])
    assert stat < CHI2_CRITICAL[df], (stat, df)
    accepted = n > 0
    stat, df = _chi2(out[accepted, 1], p[1])
    assert stat < CHI2_CRITICAL[df], (stat, df)
    assert np.all((out >= 0).sum(1) == n + 1)


def test_greedy_verify_accepts_the_argmax_prefix():
    V = 6
    logits = np.full((3, 4, V), -5.0, np.float32)
    target = np.array([[1, 2, 3, 4], [1, 2, 3, 4], [5, 5, 5, 5]])
    np.put_along_axis(logits, target[..., None], 5.0, axis=-1)
    d = jnp.asarray([[1, 2, 0], [0, 2, 3], [5, 5, 5]], jnp.int32)
    out, n = speculative.verify(
        jnp.asarray(logits),
        speculative.Draft(d),
        jnp.asarray([True, True, False]),
        jnp.asarray([9, 9, 4]),  # the ordinary sampler's token, taken by the row that does not draft
        jnp.zeros(3, jnp.int32),
        _sampling(3, 0.0),
    )
    assert np.asarray(n).tolist() == [2, 0, 0]
    assert np.asarray(out).tolist() == [[1, 2, 3, -1], [1, -1, -1, -1], [4, -1, -1, -1]]


def test_forced_oracle_accepts_its_schedule_whatever_the_target_says():
    """Benchmarks on random weights: acceptance follows L, not the logits (which here agree with no draft)."""
    k, B, L = 3, 64, 2.5
    drafter = speculative.OracleDrafter(k, 16, 50, force=True)
    state = speculative.DraftState.empty(B, 16).record(
        jnp.arange(B), jnp.tile(jnp.arange(10, 18), (B, 1)), jnp.tile(jnp.arange(8), (B, 1))
    )
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(B))
    pos = jnp.full(B, 3)
    draft = drafter.propose(jnp.float32(L), state, speculative.DraftInputs(jnp.full(B, 13), pos, jnp.arange(B), keys))
    assert np.all(np.asarray(draft.tokens_BK) == [14, 15, 16])  # the known continuation, not corrupted
    logits = jnp.zeros((B, k + 1, 50)).at[:, :, 0].set(1.0)  # the target's argmax is token 0 everywhere
    drafting = jnp.arange(B) > 0
    out, n = speculative.verify(logits, draft, drafting, jnp.full(B, 7), pos, _sampling(B, 0.0))
    n, out = np.asarray(n), np.asarray(out)
    assert set(n[1:].tolist()) == {1, 2} and 1.25 < 1 + n[1:].mean() < 2.75 and n[0] == 0
    for row in range(1, B):
        assert out[row].tolist() == [14, 15, 16, 0][: n[row]] + [0] + [-1] * (k - n[row])
    assert out[0].tolist() == [7, -1, -1, -1]


def test_ngram_drafter_proposes_what_followed_the_longest_match():
    drafter = speculative.NgramDrafter(num_tokens=3, lookup_min=1, lookup_max=3, history_tokens=16)
    state = speculative.DraftState.empty(3, 16)
    seqs = [[1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], [4, 4, 4], [8, 6]]
    for slot, s in enumerate(seqs):
        state = state.record(jnp.asarray([slot]), jnp.asarray([s]), jnp.arange(len(s))[None])
    pos = jnp.asarray([len(s) - 1 for s in seqs])
    inp = speculative.DraftInputs(jnp.asarray([3, 4, 6]), pos, jnp.arange(3), jnp.zeros((3, 2), jnp.uint32))
    got = np.asarray(drafter.propose(None, state, inp).tokens_BK).tolist()
    # [1 2 3] last occurred before 7 5 1; [4 4] repeats with period 1; no match: the last token repeated
    assert got == [[7, 5, 1], [4, 4, 4], [6, 6, 6]]


def test_metrics_expose_the_acceptance_counters():
    stats = dict(
        spec_decode_num_drafts=4,
        spec_decode_num_draft_tokens=12,
        spec_decode_num_accepted_tokens=5,
        spec_decode_num_accepted_tokens_per_pos=[3, 2, 0],
    )
    text = Metrics("m").render(stats)
    assert f'{PREFIX}:spec_decode_num_drafts_total{{model_name="m"}} 4' in text
    assert f'{PREFIX}:spec_decode_num_draft_tokens_total{{model_name="m"}} 12' in text
    assert f'{PREFIX}:spec_decode_num_accepted_tokens_total{{model_name="m"}} 5' in text
    assert f'{PREFIX}:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="1"}} 2' in text
    assert "spec_decode" not in Metrics("m").render({})  # no speculation: no such series


@pytest.mark.parametrize(
    "value,field",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "max"),
        ({"method": "eagle3", "num_speculative_tokens": 3}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 3, "model": "x"}, "model"),
        ({"method": "oracle", "num_speculative_tokens": 3, "acceptance_length": 5}, "acceptance_length"),
        ({"method": "ngram", "num_speculative_tokens": 3, "acceptance_length": 2}, "acceptance_length"),
        ({"method": "ngram", "num_speculative_tokens": 3, "num_spec_tokens": 2}, "num_spec_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 3, "force_acceptance": True}, "force_acceptance"),
        ({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0}, "disable_by_batch_size"),
        ({"method": "oracle", "num_speculative_tokens": 3, "force_acceptance": 1}, "force_acceptance"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ("{not json", "invalid JSON"),
        ([1, 2], "mapping"),
    ],
)
def test_config_errors_name_the_field(value, field):
    with pytest.raises(ConfigError, match=field):
        engine_config.load(None, speculative_config=value)


def test_config_from_the_command_line(small_checkpoint):
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    ec = cli.resolve(serve.parse_args(["--model", str(small_checkpoint), "--speculative-config", spec]))[1]
    s = ec.speculative_config
    assert (s.method, s.num_speculative_tokens, s.prompt_lookup_min, s.prompt_lookup_max) == ("ngram", 4, 3, 3)
    assert ec.decode_tokens_per_call() == 5
    eagle = dict(method="eagle3", model="some/drafter", num_speculative_tokens=3)
    assert engine_config.load(None, speculative_config=eagle).speculative_config.model == "some/drafter"
    with pytest.raises(ConfigError, match="one device"):
        engine_config.load(None, speculative_config=eagle, model_parallel=2)


def test_engine_stats_have_the_counters(small_checkpoint):
    plain = stats_dict(Engine(small_checkpoint, dtype="float32", progress=False, **SMALL).stats())
    assert plain["spec_decode_num_drafts"] == 0 and plain["spec_decode_num_accepted_tokens_per_pos"] == []


@pytest.mark.slow  # the demo model (the real vocabulary): its engine compiles for a minute on two cores
def test_structured_and_free_rows_beside_drafting_rows(tmp_path, monkeypatch):
    """Structured-output rows (which do not draft, and whose rejected tokens roll the cache back) in the same calls as
    drafting rows: the constrained answer is valid and a free greedy row is exactly the target's greedy chain."""
    pytest.importorskip("llguidance")
    from gptoss_jax.structured import StructuredOutputsParams as SO

    monkeypatch.setenv("GPTOSS_JAX_HOME", str(tmp_path))
    ngram = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)
    with LLM(
        dtype="float32",
        progress=False,
        max_num_seqs=4,
        decode_batch_buckets=[4],
        max_model_len=128,
        min_context_bucket=128,
        prefill_chunk_size=32,
        min_prefill_bucket=32,
        max_num_batched_tokens=32,
        max_prefill_seqs=1,
        decode_steps_per_call=2,
        speculative_config=ngram,
    ) as llm:
        enc = llm.engine.tokenizer
        chat = enc.encode("<|start|>user<|message|>hi<|end|><|start|>assistant", allowed_special="all")
        free = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[])
        regex = SamplingParams(
            temperature=0.8, seed=2, max_tokens=24, structured_outputs=SO(regex=r"[0-9]{3}-[a-z]{2}")
        )
        outs = llm.generate(prompt_token_ids=[chat, chat], sampling_params=[free, regex], use_tqdm=False)
        seq = list(chat)
        for tok in outs[0].outputs[0].token_ids:
            assert tok == int(np.argmax(llm.engine.prompt_logits(seq)[-1]))
            seq.append(tok)
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", enc.decode(outs[1].outputs[0].token_ids).split("<|message|>", 1)[1])
        assert outs[1].outputs[0].finish_reason == "stop"
        assert llm.engine.stats().spec_decode_num_drafts > 0
