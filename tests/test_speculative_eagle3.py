"""EAGLE-3 speculative decoding in the engine (`speculative.Eagle3Drafter`, `steps.prefill_drafting`): a random
drafter in the published layout (`random_weights.write_eagle3_drafter`) on the tiny fp32 model. Greedy outputs are
token-identical with and without it under continuous batching, chunked prefill, prefix caching and preemption, with
nothing compiled while serving; a drafter built to predict well gets its drafts accepted; the drafts the engine keeps
equal `eagle3.propose` run directly on the whole sequence (so the drafter's K/V was filled at prefill, prefix-cache
hits and verify steps alike); loading and errors through `Engine`, `LLM` and `--speculative-config`."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_speculative import REQUESTS, SMALL, _check_counters, _sampling, run

from gptoss_jax import checkpoint, cli, config, eagle3, model, random_weights, safetensors_io, serve, speculative, steps
from gptoss_jax.async_engine import stats_dict
from gptoss_jax.checkpoint import CheckpointError
from gptoss_jax.config import ConfigError
from gptoss_jax.engine import Engine
from gptoss_jax.llm import LLM
from gptoss_jax.runner import CPU_KV_BYTES
from gptoss_jax.sampling import SamplingParams
from gptoss_jax.server.metrics import PREFIX, Metrics

K = 3


@pytest.fixture(scope="module")
def target_hf(small_checkpoint):
    return json.loads((small_checkpoint / "config.json").read_text())


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, target_hf):
    """A drafter for the small target (two layers: aux layers 0, 1 and 2) with its own embedding."""
    path = tmp_path_factory.mktemp("eagle3-small")
    return random_weights.write_eagle3_drafter(path, random_weights.eagle3_config(target_hf), target_hf, seed=5)


def _spec(path, k=K):
    return dict(method="eagle3", model=str(path), num_speculative_tokens=k)


@pytest.fixture(scope="module")
def eagle_engine(small_checkpoint, drafter_dir):
    """Warmed up (serving compiles nothing); two verify steps per decode call, async scheduling."""
    return Engine(
        small_checkpoint,
        dtype="float32",
        progress=False,
        speculative_config=_spec(drafter_dir),
        warmup=True,
        **{**SMALL, "max_prefill_seqs": 1},  # two programs to compile
    )


T, S = 40, 4  # SMALL's max_model_len and page size


@pytest.fixture(scope="module")
def target(small_checkpoint):
    return checkpoint.load_params(small_checkpoint, jnp.float32, progress=False)


def _whole(cfg, n):
    """Positions (the first `n` of `T`), an empty cache and its tables, to run a padded sequence from scratch."""
    table = jnp.arange(1, T // S + 1, dtype=jnp.int32)[None]
    pos = jnp.where(jnp.arange(T) < n, jnp.arange(T), -1)[None]
    cache = model.PagedKVCache.zeros(cfg, T // S + 1, T // S + 1, S, jnp.float32)
    return pos, cache, model.PageTables(table, table, jnp.zeros(1, jnp.int32))


@pytest.fixture(scope="module")
def baseline(target):
    """rid -> the target's greedy continuation of each prompt up to max_model_len, each token the argmax after the
    whole sequence so far run from scratch (the drafts check needs the tokens the device ran ahead to)."""
    cfg, params = target

    @jax.jit
    def next_token(tokens_T, n):
        pos, cache, tables = _whole(cfg, n)
        x, *_ = model.forward(params, cache, tokens_T[None], pos, tables, cfg)
        return jnp.argmax(model.unembed(params, x[0, n - 1]))

    out = {}
    for rid, (prompt, _) in REQUESTS.items():
        seq = np.zeros(T, np.int32)
        seq[: len(prompt)] = prompt
        for n in range(len(prompt), T):
            seq[n] = int(next_token(jnp.asarray(seq), n))
        out[rid] = seq[len(prompt) :].tolist()
    return out


def _want(baseline, rid):
    return baseline[rid][: REQUESTS[rid][1].max_tokens], "length"


@pytest.mark.slow  # an EAGLE-3 engine warmed up and a baseline: ~40 s on two cores
def test_greedy_outputs_identical_and_nothing_compiles(eagle_engine, baseline):
    """Mixed lengths in one batch, a 17-token prompt in chunks of 8, two prompts sharing a prefix (again once
    cached), a row with a logits processor (does not draft), preemption; `/metrics` counts the drafts."""
    with steps.compilations() as seen:
        got = run(eagle_engine, REQUESTS)
        again = run(eagle_engine, {rid: REQUESTS[rid] for rid in ("r4", "r5")})
    assert seen == []
    assert {rid: out[:2] for rid, out in got.items()} == {rid: _want(baseline, rid) for rid in REQUESTS}
    assert {rid: out[:2] for rid, out in again.items()} == {rid: _want(baseline, rid) for rid in ("r4", "r5")}
    st = eagle_engine.stats()
    assert st.num_preemptions > 0
    _check_counters(st, K, "eagle3")
    text = Metrics("m").render(stats_dict(st))
    assert f'{PREFIX}:spec_decode_num_draft_tokens_total{{model_name="m"}} {st.spec_decode_num_draft_tokens}' in text


@pytest.mark.slow  # shares the warmed-up engine above
def test_engine_drafts_equal_propose_on_the_whole_sequence(eagle_engine, baseline, target, drafter_dir):
    """Late in each request, the drafts its slot holds for its next step equal `eagle3.propose` over the whole
    sequence from scratch (the target's aux states at every position, the drafter's K/V written by one pass). The
    engine built that K/V piecewise: in prefill chunks (the 17-token prompt), from shared prefix-cache pages (the
    second of two prompts with a common prefix) and in verify steps; a position it missed changes the drafts."""
    cfg_t, params = target
    dcfg, dparams = eagle3.load(drafter_dir, cfg_t, jnp.float32)

    @jax.jit
    def reference(tokens_T, n):
        """Drafts after position n (token n known) of the sequence `tokens_T` (padded to T)."""
        pos, cache, tables = _whole(cfg_t, n)
        *_, aux = model.forward(params, cache, tokens_T[None], pos, tables, cfg_t, aux_layers=dcfg.aux_layer_ids)
        nxt = jnp.roll(tokens_T, -1)[None]  # row p's token is p + 1's
        kv = eagle3.DraftKV.zeros(dcfg, T // S + 1, S, jnp.float32)
        pages = eagle3.Pages(tables.full_BM, jnp.zeros(1, jnp.int32))
        keys = jnp.zeros((1, 2), jnp.uint32)
        return eagle3.propose(dparams, dcfg, kv, nxt, aux, pos, pages, jnp.zeros(1), keys, num_tokens=K).tokens[0]

    engine = eagle_engine
    checked = set()
    for rids in (("r1", "r3"), ("r4",), ("r5",)):  # r1: 17 prompt tokens (chunked); r5 shares r4's prefix
        reqs = {rid: REQUESTS[rid] for rid in rids}
        for rid, (prompt, sp) in reqs.items():
            engine.add_request(rid, prompt, sp)
        last, cached = {}, {}
        while engine.has_unfinished_requests():
            engine.step()
            state = engine.runner._draft_state  # as the last call dispatched leaves it
            for s in (s for s in engine.scheduler.running if s.slot >= 0):
                cached[s.request_id] = s.full_cached
                n = int(state.next_pos_S[s.slot])  # the slot's next input position; its token `next_token_S`
                # calls running past the request's end write K/V outside its pages: those states are not checked
                if n < len(reqs[s.request_id][0]) + reqs[s.request_id][1].max_tokens:
                    last[s.request_id] = (n, int(state.next_token_S[s.slot]), np.asarray(state.drafts_SK[s.slot]))
        if "r5" in reqs:
            assert cached["r5"] > 0  # r5 read r4's prefix pages: its drafter K/V there is r4's
        for rid, (n, token, drafts) in last.items():
            full = reqs[rid][0] + baseline[rid]
            assert token == full[n], rid
            tokens = np.zeros(T, np.int32)
            tokens[: len(full)] = full
            assert drafts.tolist() == np.asarray(reference(jnp.asarray(tokens), n)).tolist(), rid
            checked.add(rid)
    assert checked == {"r1", "r3", "r4", "r5"}


def _copy_drafter(path, drafter_dir, target, target_ids):
    """A drafter in the same layout as `drafter_dir`'s whose drafts are the target's own greedy prediction at the
    drafted-from position, i.e. the row's next token repeated k times: `fc` passes the last aux state through (the
    target's residual after its last layer), attention and MLP add nothing (`o_proj`, `down_proj` zero) and
    `lm_head` and `norm` are the target's unembedding (rows `target_ids`, mapped back by `d2t`) and final norm."""
    cfg_t, params = target
    hf = json.loads((drafter_dir / "config.json").read_text())
    dcfg = eagle3.from_hf_dict(hf, cfg_t)
    H, ids = dcfg.hidden_size, np.asarray(sorted(target_ids))
    tensors = {}
    for name, (field, shape) in eagle3.tensor_specs(dcfg).items():
        tensors[name] = np.ones(shape, np.float32) if "norm" in name else np.zeros(shape, np.float32)
    tensors["fc.weight"][:, 2 * H :] = np.eye(H)
    tensors["midlayer.self_attn.q_proj.weight"][:] = 0.1
    tensors["midlayer.self_attn.k_proj.weight"][:] = 0.1
    tensors["embed_tokens.weight"] = np.asarray(params.embed, np.float32)
    tensors["norm.weight"] = np.asarray(params.final_norm, np.float32)
    tensors["lm_head.weight"] = np.asarray(params.unembed, np.float32)[ids]
    tensors["d2t"] = (ids - np.arange(len(ids))).astype(np.int64)
    del tensors["t2d"]
    path.mkdir()
    specs = {n: (a.shape, a.dtype) for n, a in tensors.items()}
    safetensors_io.write(path / "model.safetensors", tensors.items(), specs, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf))
    return eagle3.load(path, cfg_t, jnp.float32)[1]


@pytest.mark.slow  # shares the warmed-up engine above
def test_a_drafter_that_predicts_well_gets_accepted(eagle_engine, baseline, target, drafter_dir, tmp_path):
    """With the weights of a drafter that proposes the next token repeated (same layout and shapes as the random
    one: the same compiled programs), r4's greedy output, which repeats one token six times, gets all three drafts
    accepted where the run starts and stays the target's; sampled rows (q not one-hot) run through the rejection
    sampler. Nothing compiles."""
    runner = eagle_engine.runner
    random_params, before = runner.draft_params, eagle_engine.stats()
    want = _want(baseline, "r4")
    vocab = set(want[0])
    vocab |= set([t for t in range(512) if t not in vocab][: 128 - len(vocab)])  # the draft vocabulary: 128 ids
    try:
        runner.draft_params = jax.device_put(
            _copy_drafter(tmp_path / "copy", drafter_dir, target, vocab), jax.devices()[0]
        )
        with steps.compilations() as seen:
            got = run(eagle_engine, {"r4": REQUESTS["r4"]})
            accepted = eagle_engine.stats().spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
            sp = SamplingParams(temperature=0.8, seed=3, max_tokens=10, stop_token_ids=[])
            sampled = run(eagle_engine, {"s0": (REQUESTS["r0"][0], sp), "s1": (REQUESTS["r3"][0], sp)})
        assert seen == []
    finally:
        runner.draft_params = random_params
    assert got["r4"][:2] == want
    assert accepted >= 3  # the verify step fed the first 298 accepts the three drafts 298 298 298
    for tokens, reason, _ in sampled.values():
        assert len(tokens) == 10 and reason == "length" and all(0 <= t < 512 for t in tokens)


def test_eagle3_through_llm_and_the_command_line(small_checkpoint, drafter_dir, tmp_path):
    """`--speculative-config` carries the method and model; the drafter is checked against the target at start-up,
    each error naming `speculative_config.model`, the file and the field or tensor."""
    spec = json.dumps(_spec(drafter_dir))
    ec = cli.resolve(serve.parse_args(["--model", str(small_checkpoint), "--speculative-config", spec]))[1]
    assert (ec.speculative_config.method, ec.speculative_config.model) == ("eagle3", str(drafter_dir))
    with pytest.raises(CheckpointError, match=r"speculative_config.model='/nonexistent/drafter'.*not found"):
        LLM(small_checkpoint, dtype="float32", progress=False, speculative_config=_spec("/nonexistent/drafter"))
    hf = json.loads((drafter_dir / "config.json").read_text())
    bad = tmp_path / "wide"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**hf, "hidden_size": 32}))
    with pytest.raises(ConfigError, match=r"speculative_config.model=.*config.json: field 'hidden_size' is 32"):
        LLM(small_checkpoint, dtype="float32", progress=False, speculative_config=_spec(bad))
    (bad / "config.json").write_text(json.dumps({**hf, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 5]}}))
    with pytest.raises(ConfigError, match=r"eagle_aux_hidden_state_layer_ids' is \[0, 5\].*in 0\.\.2"):
        LLM(small_checkpoint, dtype="float32", progress=False, speculative_config=_spec(bad))
    (bad / "config.json").write_text(json.dumps(hf))  # the config fits, the folder has no weights
    with pytest.raises(CheckpointError, match=r"speculative_config.model=.*wide"):
        LLM(small_checkpoint, dtype="float32", progress=False, speculative_config=_spec(bad))


def test_drafter_pool_takes_its_share_of_the_kv_budget(small_checkpoint, drafter_dir):
    """Sized from memory (here the CPU's fixed budget), the target's pools and the drafter's (a page per full-layer
    page) fit the budget together."""
    kw = {k: v for k, v in SMALL.items() if k != "num_pages"}
    runner = Engine(
        small_checkpoint, dtype="float32", progress=False, speculative_config=_spec(drafter_dir), **kw
    ).runner
    kv = runner._draft_state.kv
    assert kv.k.shape[:2] == (runner.num_pages_full, SMALL["page_size"])
    total = sum(a.nbytes for a in jax.tree.leaves((runner.cache, kv)))
    assert CPU_KV_BYTES * 0.95 < total <= CPU_KV_BYTES


def test_verify_maps_a_draft_vocabulary_q_as_the_full_one():
    """q over a draft vocabulary with its target ids (`Draft.q_ids_V`, as the EAGLE-3 drafter hands it over) accepts
    and resamples exactly as the same q scattered over the target's vocabulary."""
    B, V, k, Vd = 64, 16, 2, 5
    rng = np.random.default_rng(1)
    ids = np.sort(rng.choice(V, Vd, replace=False))
    q = rng.dirichlet(np.ones(Vd), size=(B, k)).astype(np.float32)
    d = np.stack([[rng.choice(Vd, p=q[b, j]) for j in range(k)] for b in range(B)])
    full = np.zeros((B, k, V), np.float32)
    full[:, :, ids] = q
    logits = jnp.asarray(rng.normal(0, 1.5, (B, k + 1, V)), jnp.float32)
    args = (jnp.ones(B, bool), jnp.zeros(B, jnp.int32), jnp.zeros(B, jnp.int32), _sampling(B, 0.9))
    tokens = jnp.asarray(ids[d], jnp.int32)
    a = speculative.verify(logits, speculative.Draft(tokens, jnp.asarray(q), jnp.asarray(ids, jnp.int32)), *args)
    b = speculative.verify(logits, speculative.Draft(tokens, jnp.asarray(full)), *args)
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
    assert 0 < int(np.asarray(a[1]).sum()) < B * k  # some drafts accepted, some not


def test_bench_times_an_eagle3_drafter():
    """`tools.bench_speculative --method eagle3`'s timing on the smoke model: a random drafter in the published
    shapes (MLP 6x, a quarter of a small vocabulary), propose and one draft step."""
    from tools import bench_speculative
    from tools.bench_throughput import SMOKE

    (row,) = bench_speculative.eagle3_times(config.from_hf_dict(SMOKE), 2, [2], 24)
    assert row["propose_ms"] > 0 and row["step_ms"] > 0 and row["batch"] == 2
    assert (row["intermediate"], row["draft_vocab"]) == (6 * SMOKE["hidden_size"], SMOKE["vocab_size"] // 4)
