"""The serving engine on a tiny fp32 model: continuous batching, chunked prefill, preemption, prefix
caching, multi-step decode, compile stability, sampling parameters."""

import logging
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gptoss_jax import checkpoint, steps, upload
from gptoss_jax.engine import Engine
from gptoss_jax.sampling import SamplingParams

# 4-token pages and 8-token chunks so prompts span many pages and chunks; 12 usable full pages
# (48 tokens) so a few long requests exhaust the cache and force preemption.
SMALL = dict(
    page_size=4,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    prefill_chunk_size=8,
    max_prefill_seqs=2,
    num_pages=13,
    max_model_len=40,
    min_context_bucket=256,
    max_logprobs=5,
)


@pytest.fixture(scope="module")
def engine(small_checkpoint):
    return Engine(small_checkpoint, dtype="float32", progress=False, warmup=True, **SMALL)


def greedy(n, **kw):
    return SamplingParams(**{"temperature": 0, "max_tokens": n, "stop_token_ids": [], **kw})


def run(engine, requests):
    """requests: {id: (prompt, params)} -> {id: (tokens, finish_reason, stop_reason)}; all added at once."""
    for rid, (prompt, sp) in requests.items():
        engine.add_request(rid, prompt, sp)
    out = {rid: [] for rid in requests}
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            if o.finished:
                done[o.request_id] = (out[o.request_id], o.finish_reason, o.stop_reason)
    return done


def alone(engine, prompt, sp):
    return run(engine, {"alone": (prompt, sp)})["alone"]


def prompts(n, lo, hi, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 512, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def test_concurrent_requests_match_each_alone(engine):
    reqs = {f"r{i}": (p, greedy(3 + i % 5)) for i, p in enumerate(prompts(7, 2, 20, seed=0))}
    together = run(engine, reqs)
    assert engine.stats().num_running == engine.stats().num_waiting == 0
    for rid, (p, sp) in reqs.items():
        assert together[rid] == alone(engine, p, sp), rid
        assert len(together[rid][0]) == sp.max_tokens and together[rid][1] == "length"
    # and the paged, chunked path matches a plain full forward (argmax at every step)
    p, sp = reqs["r3"]
    seq = list(p)
    for tok in together["r3"][0]:
        assert tok == int(np.argmax(engine.prompt_logits(seq)[-1]))
        seq.append(tok)


def test_preemption_under_tiny_cache_loses_nothing(engine):
    reqs = {f"p{i}": (p, greedy(38 - len(p))) for i, p in enumerate(prompts(4, 6, 16, seed=1))}
    before = engine.stats().num_preemptions
    together = run(engine, reqs)
    assert engine.stats().num_preemptions > before  # 4 x 38 tokens cannot fit in 48 token slots
    assert engine.stats().kv_cache_usage == 0
    for rid, (p, sp) in reqs.items():
        assert together[rid] == alone(engine, p, sp), rid
        assert len(p) + len(together[rid][0]) == 38


def test_seeded_sampling_independent_of_batch_and_preemption(engine):
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=20, stop_token_ids=[])
    p = prompts(1, 10, 11, seed=2)[0]
    ref = alone(engine, p, sp)
    others = {
        f"o{i}": (q, SamplingParams(temperature=0.8, seed=i, max_tokens=30, stop_token_ids=[]))
        for i, q in enumerate(prompts(3, 6, 12, seed=3))
    }
    got = run(engine, {"x": (p, sp), **others})
    assert got["x"] == ref
    assert alone(engine, p, SamplingParams(**{**vars(sp), "seed": 8}))[0] != ref[0]


def test_prefix_cache_hit_gives_identical_output(engine):
    shared = prompts(1, 30, 31, seed=4)[0]
    a, b = shared + [5, 6], shared + [7]
    engine.kv.full.caching = False
    try:
        expect_b = alone(engine, b, greedy(6))
    finally:
        engine.kv.full.caching = True
    alone(engine, a, greedy(6))  # fills the cache with shared's pages
    engine.add_request("b", b, greedy(6))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [t for o in outs for t in o.new_token_ids] == expect_b[0]
    # 28 tokens of full pages hit; the sliding layer's window (7 tokens) before them is recomputed
    assert outs[-1].num_cached_prompt_tokens == 28 - 7


def test_compile_count_flat_after_warmup(engine):
    before = sum(steps.TRACES.values())
    with steps.compilations() as seen:
        _serve_a_mix(engine)
    assert sum(steps.TRACES.values()) == before
    assert engine.stats().num_compiles == before
    assert seen == []


def test_each_step_takes_its_host_arrays_as_one_buffer(engine):
    """On one device every compiled step's batch is one packed i32 buffer (`upload.Packed`: one transfer a call) plus
    the arrays already on the device."""
    assert engine.runner._programs
    for key, program in engine.runner._programs.items():
        batch = program.args_info[0][3]
        assert isinstance(batch, upload.Packed), key
        assert batch.words.shape[0] == sum(math.prod(s.shape) for s in batch.layout[1] if s is not None), key


def test_no_step_copies_a_cache_pool_more_than_once(engine):
    """The steps write the donated cache in place. On CPU a batch-1 decode step still copies each pool once (its one
    token's write becomes a select and an update of the old page); without the barrier in `model._attention` XLA
    copied each 3 times, fusing the reference attention's read through the write (~90% of the demo's decode step)."""
    cache = engine.runner.cache
    pools = [cache.k_sliding, cache.v_sliding, cache.k_full, cache.v_full]
    shapes = {tuple(a.shape) for a in pools} | {tuple(a.shape[1:]) for a in pools}  # as stacked, and flat
    assert engine.runner._programs
    for key, program in engine.runner._programs.items():
        copies = re.findall(r"= \w+\[([\d,]*)\]\{[^}]*\} copy\(", program.as_text())
        assert sum(tuple(int(d) for d in c.split(",") if d) in shapes for c in copies) <= len(pools), key


def test_a_step_whose_temporaries_do_not_fit_is_refused_before_it_runs(engine):
    """XLA's memory analysis of the warmed-up steps: the largest is a real bucket; when the device has less free
    than it needs (here a pretend GPU's statistics), warm-up's check names the step and what to lower."""
    runner = engine.runner
    key, need = runner.largest_temporaries()
    assert key in runner.buckets() and need > 0
    runner.check_temporaries({"bytes_limit": 10 * need, "bytes_in_use": 8 * need})  # fits: no error
    with pytest.raises(ValueError, match=r"the (prefill|decode) rows=\d+ .* step needs .* gpu_memory_utilization"):
        runner.check_temporaries({"bytes_limit": 10 * need, "bytes_in_use": 10 * need - need // 2})
    runner.check_temporaries({})  # no statistics (CPU): nothing to check


@pytest.mark.slow  # a second engine compiles its whole bucket grid
def test_committed_parameters_compile_nothing_after_warmup(small_checkpoint):
    """Parameters the caller placed on a device are committed, and so is every step's output then; warm-up
    must have compiled the programs for the arguments real calls pass."""
    cfg, params = checkpoint.load(small_checkpoint, jnp.float32, progress=False)
    eng = Engine(loaded=(cfg, jax.device_put(params, jax.devices()[0])), progress=False, warmup=True, **SMALL)
    with steps.compilations() as seen:
        _serve_a_mix(eng)
    eng.close()
    assert seen == []


def _serve_a_mix(engine):
    """Requests arriving mid-run, an abort, stops at several lengths, log-probabilities."""
    reqs = {f"c{i}": (p, greedy(1 + 3 * i)) for i, p in enumerate(prompts(6, 1, 30, seed=5))}
    for rid, (p, sp) in list(reqs.items())[:3]:
        engine.add_request(rid, p, sp)
    engine.step()
    engine.abort_request("c1")
    for rid, (p, sp) in list(reqs.items())[3:]:
        engine.add_request(rid, p, sp)
    while engine.has_unfinished_requests():
        engine.step()
    run(engine, {"lp": (prompts(1, 5, 6, seed=6)[0], greedy(3, logprobs=2))})


def test_abort_frees_pages(engine):
    engine.add_request("x", list(range(2, 30)), greedy(10))
    engine.step()
    assert engine.stats().kv_cache_usage > 0
    engine.abort_request("x")
    assert engine.stats().kv_cache_usage == 0
    (out,) = engine.step()
    assert out.finished and out.finish_reason == "abort" and not engine.has_unfinished_requests()


def test_logprobs(engine):
    p = prompts(1, 9, 10, seed=7)[0]
    (o,) = [o for o in _steps(engine, "l", p, greedy(2, logprobs=3)) if o.new_token_ids][:1]
    lp, top = o.logprobs[0]
    logits = engine.prompt_logits(p)[-1]
    ref = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    assert np.isclose(lp, ref[o.new_token_ids[0]], atol=1e-4)
    assert [t for t, _ in top] == list(np.argsort(-ref)[:3]) and top[0][0] == o.new_token_ids[0]


def test_greedy_calls_take_programs_without_conditionals(engine, monkeypatch):
    """Calls whose rows are all greedy, without processors, masks or log-probabilities run a program traced without
    the sampler's conditionals (`StepConfig.plain`); the same greedy request asking for log-probabilities runs the
    other program, and both give the same tokens."""
    p = prompts(1, 9, 14, seed=17)[0]
    used = []
    program = engine.runner._program
    monkeypatch.setattr(engine.runner, "_program", lambda key, *a: used.append(key) or program(key, *a))
    plain = alone(engine, p, greedy(6))
    first = len(used)
    with_lp = alone(engine, p, greedy(6, logprobs=1))
    monkeypatch.undo()
    greedy_calls, other_calls = ([k[4] for k in keys if k[0] == "decode"] for keys in (used[:first], used[first:]))
    assert greedy_calls and all(greedy_calls) and other_calls and not any(other_calls)
    assert plain[0] == with_lp[0]
    key = next(k for k in engine.runner.buckets() if k[0] == "decode" and k[4])
    step, batch = engine.runner._padding(key)
    text = {
        greedy_: step.lower(*engine.runner._args("decode", batch), st=engine.runner._st(key[:4] + (greedy_,))).as_text()
        for greedy_ in (True, False)
    }
    assert "stablehlo.case" not in text[True] and "stablehlo.case" in text[False]


def test_greedy_programs_only_up_to_greedy_program_rows(small_checkpoint):
    """`greedy_program_rows` bounds the buckets that get the greedy calls' program (each one more to compile); 0 gives
    none, and a bad value is named."""
    from gptoss_jax.config import ConfigError

    def decode(**kw):
        eng = Engine(small_checkpoint, dtype="float32", progress=False, **{**SMALL, **kw})
        keys = [k for k in eng.runner.buckets() if k[0] == "decode"]
        eng.close()
        return sorted((k[1], k[4]) for k in keys)

    assert decode() == [(1, False), (1, True), (2, False), (2, True), (4, False), (4, True)]
    assert decode(greedy_program_rows=2) == [(1, False), (1, True), (2, False), (2, True), (4, False)]
    assert decode(greedy_program_rows=0) == [(1, False), (2, False), (4, False)]
    with pytest.raises(ConfigError, match="greedy_program_rows=-1"):
        Engine(small_checkpoint, dtype="float32", progress=False, **{**SMALL, "greedy_program_rows": -1})


def _steps(engine, rid, p, sp):
    engine.add_request(rid, p, sp)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def test_multi_step_decode_matches_single_step(engine, multi_engine):
    reqs = {f"m{i}": (p, greedy(2 + 3 * i)) for i, p in enumerate(prompts(3, 3, 12, seed=8))}
    assert run(multi_engine, reqs) == run(engine, reqs)


def test_a_request_ending_inside_a_multi_step_call_with_the_kernels(small_checkpoint):
    """With the Pallas kernels (interpret mode here) in bf16, where the decode MoE routes in-kernel: the steps a
    request ends by length before run as padding (`steps.useful`), a call's last ones not live at all (the kernels
    skip their weight reads, `pallas_kernels.layer_index`); its tokens are those of single-step calls."""
    kw = dict(dtype="bfloat16", impl="pallas", progress=False, **SMALL)
    reqs = {f"k{i}": (p, greedy(2 + i)) for i, p in enumerate(prompts(2, 3, 12, seed=9))}
    multi = run(Engine(small_checkpoint, **{**kw, "decode_steps_per_call": 4}), reqs)
    assert multi == run(Engine(small_checkpoint, **kw), reqs)
    assert [len(multi[r][0]) for r in reqs] == [2, 3]  # 1 and 2 decode steps of a 4-step call: 2 not live


def test_steps_past_the_length_limit_are_padding():
    """`steps.useful`: an input at a row's last position or after makes a token the host drops (-1: padding)."""
    batch = steps.DecodeBatch(None, None, None, None, None, jnp.asarray([5, 9], jnp.int32))
    pos = jnp.asarray([[3, 4, 5, 6], [7, 8, 9, -1]], jnp.int32)
    assert steps.useful(pos, batch).tolist() == [[3, 4, -1, -1], [7, 8, -1, -1]]


class ByteTokenizer:
    """Token t is the text '<t>'."""

    def decode_single_token_bytes(self, t):
        return f"<{t}>".encode()

    def decode(self, ids):
        return "".join(f"<{t}>" for t in ids)


def test_stop_strings_and_stop_tokens(small_checkpoint, engine):
    p = prompts(1, 8, 9, seed=9)[0]
    free = alone(engine, p, greedy(8))[0]
    e = Engine(small_checkpoint, dtype="float32", progress=False, tokenizer=ByteTokenizer(), **SMALL)
    stop = f"{free[2]}>"  # completes with the third token
    toks, reason, stop_reason = run(e, {"s": (p, greedy(8, stop=["never", stop]))})["s"]
    assert (toks, reason, stop_reason) == (free[:3], "stop", stop)
    toks, reason, stop_reason = run(
        e, {"t": (p, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[free[4]]))}
    )["t"]
    assert (toks, reason, stop_reason) == (free[: free.index(free[4])], "stop", free[4])


@pytest.mark.parametrize(
    "prompt,kw,match",
    [
        (list(range(2, 42)), {}, "prompt has 40 tokens; the context limit is 40"),
        ([1, 2], dict(logprobs=6), r"SamplingParams\.logprobs=6: at most max_logprobs=5"),
        ([1, 2], dict(stop=["x"]), r"SamplingParams\.stop=.*need a tokenizer"),
        ([], {}, "empty prompt"),
        ([1, 999], {}, "token id 999 is outside"),
    ],
)
def test_bad_requests(engine, prompt, kw, match):
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, greedy(2, **kw))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(logprobs=-1), "logprobs"),
        (dict(stop=[""]), "stop"),
        (dict(stop=[3]), "stop"),
        (dict(logprobs=True), "logprobs"),
        (dict(top_k=2**31), "top_k"),
        (dict(seed=2**64), "seed"),
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(max_tokens=2**31), "max_tokens"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=1e39), "temperature"),
        (dict(stop=["s"] * 17), "stop"),
        (dict(stop="s" * 1025), "stop"),
        (dict(stop_token_ids=[2**31]), "stop_token_ids"),
        (dict(stop_token_ids=list(range(1025))), "stop_token_ids"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-2.01), "frequency_penalty"),
        (dict(frequency_penalty=True), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(repetition_penalty=float("nan")), "repetition_penalty"),
        (dict(logit_bias={1: 100.5}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={"1": 1.0}), "logit_bias"),
        (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias"),
        (dict(logit_bias=[1]), "logit_bias"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(ignore_eos=1), "ignore_eos"),
        (dict(bad_words="word"), "bad_words"),
        (dict(bad_words=[" "]), "bad_words"),
        (dict(bad_words=["w"] * 33), "bad_words"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
        (dict(allowed_token_ids=list(range(1025))), "allowed_token_ids"),
        (dict(n=3, best_of=2), "best_of"),
    ],
)
def test_bad_new_sampling_params(kw, match):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{match}="):
        SamplingParams(**kw)


def test_batch_job_resumes(engine, tmp_path):
    import json

    from gptoss_jax import batch

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [
        {"id": "a", "prompt_token_ids": [5, 6, 7], "max_tokens": 4},
        {"prompt_token_ids": [8, 9], "max_tokens": 3, "logprobs": 1},
    ]
    src.write_text(json.dumps(rows[0]) + "\n")
    first = batch.run(engine, src, dst, dict(temperature=0, stop_token_ids=[]), progress=False)
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    second = batch.run(engine, src, dst, dict(temperature=0, stop_token_ids=[]), progress=False)
    assert (first["requests"], second["requests"], second["skipped"]) == (1, 1, 1)
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [o["id"] for o in out] == ["a", "2"] and len(out[1]["logprobs"]) == 3
    assert out[0]["token_ids"] == alone(engine, [5, 6, 7], greedy(4))[0]


def test_batch_job_bad_lines_order_and_duplicates(engine, tmp_path):
    """A bad line is an error record and the job goes on; `ordered` writes in input order; duplicate ids are
    named (with their lines) before anything runs."""
    import json

    from gptoss_jax import batch

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        json.dumps({"id": "long", "prompt_token_ids": [5, 6, 7], "max_tokens": 9}),
        '{"prompt_token_ids": [1], "max_tokenz": 3}',
        "not json",
        json.dumps({"id": "big", "prompt_token_ids": [1] * (engine.max_model_len + 1)}),
        json.dumps({"id": "short", "prompt_token_ids": [8, 9], "max_tokens": 1}),
    ]
    src.write_text("\n".join(lines) + "\n")
    summary = batch.run(engine, src, dst, dict(temperature=0, stop_token_ids=[]), progress=False, ordered=True)
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [o["id"] for o in out] == ["long", "2", "3", "big", "short"]  # input order, though "short" ends first
    assert out[1]["error"] == f"{src}:2: unknown field(s) ['max_tokenz']"
    assert out[2]["error"].startswith(f"{src}:3: invalid JSON")
    assert out[3]["error"].startswith(f"{src}:4: request big: prompt has") and len(out[4]["token_ids"]) == 1
    assert (summary["requests"], summary["errors"]) == (2, 3)
    dst.unlink()
    batch.run(engine, src, dst, dict(temperature=0, stop_token_ids=[]), progress=False)
    assert [json.loads(line)["id"] for line in dst.read_text().splitlines()][-2:] == ["short", "long"]  # as finished
    src.write_text('{"id": "a", "prompt_token_ids": [1]}\n{"id": "b", "prompt_token_ids": [1]}\n' * 2)
    with pytest.raises(ValueError, match=r"2 duplicate request id\(s\): 'a' \(lines 1, 3\), 'b' \(lines 2, 4\)"):
        batch.run(engine, src, dst, {}, progress=False)


def test_batch_resume_repairs_a_cut_last_line(engine, tmp_path):
    """A crash mid-write leaves half a record without its newline: the rerun drops it and redoes that request, so
    every line parses and each record is there once."""
    import json

    from gptoss_jax import batch

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"id": r, "prompt_token_ids": [5, 6, 7 + i], "max_tokens": 3} for i, r in enumerate("abc")]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    defaults = dict(temperature=0, stop_token_ids=[])
    batch.run(engine, src, dst, defaults, progress=False)
    lines = dst.read_text().splitlines(keepends=True)
    want = sorted(lines)
    dst.write_text(lines[0] + lines[1][: len(lines[1]) // 2])
    second = batch.run(engine, src, dst, defaults, progress=False)
    assert (second["requests"], second["skipped"], second["failed"]) == (2, 1, 0)
    assert sorted(dst.read_text().splitlines(keepends=True)) == want
    dst.write_text(lines[0][:10])  # nothing whole at all
    assert batch.run(engine, src, dst, defaults, progress=False)["requests"] == 3
    assert sorted(dst.read_text().splitlines(keepends=True)) == want


def test_async_scheduling_matches_sync(small_checkpoint, engine):
    """Dispatching a step before reading the last one changes nothing a request sees, through
    multi-step decode, stops inside a call, preemption and seeded sampling."""
    assert engine.config.async_scheduling  # the default, used by every test above
    kw = {**SMALL, "decode_steps_per_call": 3}
    sync = Engine(small_checkpoint, dtype="float32", progress=False, async_scheduling=False, **kw)
    pipelined = Engine(small_checkpoint, dtype="float32", progress=False, **kw)
    ps = prompts(5, 4, 14, seed=10)
    free = alone(sync, ps[0], greedy(8))[0]
    reqs = {
        "stop": (ps[0], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[free[4]])),
        "seeded": (ps[1], SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=20, stop_token_ids=[])),
        **{f"g{i}": (p, greedy(36 - len(p))) for i, p in enumerate(ps[2:])},
    }
    expect = run(sync, reqs)
    before = pipelined.stats().num_preemptions
    assert run(pipelined, reqs) == expect
    assert pipelined.stats().num_preemptions > before and pipelined.stats().kv_cache_usage == 0
    assert expect["stop"] == (free[: free.index(free[4])], "stop", free[4])


def test_abort_while_a_call_is_in_flight(engine):
    engine.add_request("a", list(range(2, 12)), greedy(10))
    engine.add_request("b", list(range(3, 9)), greedy(4))
    while engine.stats().num_running < 2 or engine.scheduler.running[0].num_pending == 0:
        engine.step()
    engine.abort_request("a")  # its in-flight tokens must not come back
    outs = [o for _ in range(30) for o in engine.step()]
    assert [o.finish_reason for o in outs if o.request_id == "a"] == ["abort"]
    assert sum(len(o.new_token_ids) for o in outs if o.request_id == "b") > 0
    assert not engine.has_unfinished_requests() and engine.stats().kv_cache_usage == 0


class _Poison(tuple):
    """A stop-token list that raises when read: a bad value reaching the engine past validation."""

    def __contains__(self, item):
        raise RuntimeError("injected fault")


def _drain(engine):
    """Step until idle: {id: (tokens, finish_reason, error)}."""
    out, done = {}, {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                done[o.request_id] = (out[o.request_id], o.finish_reason, o.error)
    return done


def test_a_fault_in_one_request_fails_only_it(engine):
    """A request whose value breaks the host-side step fails alone; its neighbours and later requests are exact."""
    pa, pb = prompts(2, 5, 9, seed=11)
    want = alone(engine, pa, greedy(6))
    bad = greedy(6)
    bad.stop_token_ids = _Poison()
    engine.add_request("good", pa, greedy(6))
    engine.add_request("bad", pb, bad)
    done = _drain(engine)
    assert done["good"][:2] == (want[0], "length")
    assert (
        done["bad"][1] == "error" and "request bad failed in the engine: RuntimeError: injected fault" in done["bad"][2]
    )
    assert engine.stats().kv_cache_usage == 0 and engine.stats().num_running == 0
    assert alone(engine, pa, greedy(6)) == want


@pytest.mark.parametrize(
    "stage,where",
    [
        ("decode", "read"),
        pytest.param("decode", "launch", marks=pytest.mark.slow),
        pytest.param("prefill", "read", marks=pytest.mark.slow),
    ],
)
def test_a_failed_device_call_fails_its_batch_and_the_engine_goes_on(engine, monkeypatch, stage, where):
    """A device call that raises when dispatched, or whose results cannot be read (a kernel error surfaces there),
    fails the requests of that call; the others, and requests after, run exactly."""
    ps = prompts(3, 5, 9, seed=12)
    want = [alone(engine, p, greedy(6))[0] for p in ps]
    real, calls = getattr(engine.runner, stage), []

    class Unreadable:
        def __array__(self, *a, **k):
            raise RuntimeError("injected device fault")

    def faulty(items, *args):
        calls.append({getattr(x, "seq", x).request_id for x in items})
        if len(calls) > 1:
            return real(items, *args)
        if where == "launch":
            raise RuntimeError("injected device fault")
        sampled, *rest = real(items, *args)  # (and, for decode, each row's structured-output mask)
        return sampled.replace(tokens=Unreadable()), *rest

    monkeypatch.setattr(engine.runner, stage, faulty)
    for i, p in enumerate(ps[:2]):
        engine.add_request(f"r{i}", p, greedy(6))
    done = _drain(engine)
    failed = {r for r, d in done.items() if d[1] == "error"}
    assert failed == calls[0] and all("injected device fault" in done[r][2] for r in failed)
    for i in range(2):
        if f"r{i}" not in failed:
            assert done[f"r{i}"][:2] == (want[i], "length")
    assert engine.stats().kv_cache_usage == 0
    engine.add_request("c", ps[2], greedy(6))
    engine.add_request("a2", ps[0], greedy(6))
    done = _drain(engine)
    assert done["c"][0] == want[2] and done["a2"][0] == want[0]


def test_sampling_values_beyond_the_engine_are_refused(engine):
    """The report's crash: top_k past int32 used to overflow the packing on the engine thread."""
    with pytest.raises(ValueError, match=r"SamplingParams\.top_k=2147483648"):
        greedy(2, top_k=2**31)
    with pytest.raises(ValueError, match=r"top_k=600: at most the vocabulary size 512"):
        engine.add_request("k", [1, 2], greedy(2, top_k=600))
    assert not engine.has_unfinished_requests()


def test_async_engine_keeps_serving_when_requests_fail(engine):
    """Faults injected while other requests stream: only the faulty request fails, the others finish exactly,
    and the AsyncEngine is neither dead nor holding pages afterwards."""
    import asyncio

    from gptoss_jax.async_engine import AsyncEngine, RequestFailedError

    ps = prompts(4, 5, 9, seed=13)
    want = [alone(engine, p, greedy(8))[0] for p in ps]
    bad = greedy(8)
    bad.stop_token_ids = _Poison()

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        await ae.wait_loaded()

        async def one(i, p, sp):
            toks = []
            async for o in ae.generate(f"r{i}", p, sp):
                toks += o.new_token_ids
            return toks

        try:
            res = await asyncio.gather(
                *(one(i, p, greedy(8)) for i, p in enumerate(ps)), one(9, ps[0], bad), return_exceptions=True
            )
            after = await one(10, ps[1], greedy(8))
        finally:
            ae.shutdown()
        return ae, res, after

    ae, res, after = asyncio.run(main())
    assert res[:4] == want and isinstance(res[4], RequestFailedError) and "injected fault" in str(res[4])
    assert after == want[1] and ae.dead is None
    assert engine.stats().kv_cache_usage == 0 and not engine.has_unfinished_requests()


# ---- logits processors (penalties, logit_bias, allowed_token_ids, bad_words, min_tokens, ignore_eos) ----------


def reference_processors(logits, prompt, generated, sp, bad_words_ids=()):
    """The processors of `sampling.apply_penalties_and_bias` written plainly over one row (numpy)."""
    x = np.array(logits, np.float32)
    V = len(x)
    if sp.allowed_token_ids:
        keep = np.zeros(V, bool)
        keep[list(sp.allowed_token_ids)] = True
        x[~keep] = -np.inf
    for word in bad_words_ids:
        prefix = list(word[:-1])
        if len(prefix) <= len(generated) and (not prefix or list(generated[-len(prefix) :]) == prefix):
            x[word[-1]] = -np.inf
    if len(generated) < sp.min_tokens:
        x[list(sp.stop_token_ids)] = -np.inf
    for t, b in (sp.logit_bias or {}).items():
        x[t] += np.float32(b)
    counts = np.bincount(np.asarray(generated, int), minlength=V)[:V].astype(np.float32)
    seen = (counts > 0) | np.isin(np.arange(V), prompt)
    r = np.float32(sp.repetition_penalty)
    x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    return x - np.float32(sp.frequency_penalty) * counts - np.float32(sp.presence_penalty) * (counts > 0)


def reference_greedy(engine, prompt, sp, bad_words_ids=()):
    """Greedy decoding with the processors applied to full-forward logits on the host."""
    out = []
    while len(out) < sp.max_tokens:
        x = reference_processors(engine.prompt_logits(prompt + out)[-1], prompt, out, sp, bad_words_ids)
        tok = int(np.argmax(x))
        if tok in sp.stop_token_ids and len(out) >= sp.min_tokens:
            break
        out.append(tok)
    return out


@pytest.fixture(scope="module")
def multi_engine(small_checkpoint):
    """4 decode steps per call: processors must see the tokens sampled earlier in the same call."""
    return Engine(small_checkpoint, dtype="float32", progress=False, **{**SMALL, "decode_steps_per_call": 4})


REPEATS = prompts(3, 4, 10, seed=0)[2]  # greedy output repeats tokens (4 repeats in 20)


@pytest.mark.parametrize(
    "kw",
    [
        dict(frequency_penalty=1.0),
        dict(presence_penalty=1.5),
        dict(repetition_penalty=1.8),
        dict(presence_penalty=-0.5, frequency_penalty=0.7, repetition_penalty=1.3),
        dict(logit_bias={7: 3.0, 100: -2.5}),
        dict(allowed_token_ids=[3, 5, 7, 11, 13]),
        dict(min_tokens=6),
    ],
    ids=str,
)
def test_processors_match_the_host_reference_in_single_and_multi_step_decode(engine, multi_engine, kw):
    sp = greedy(12, **kw)
    if "min_tokens" in kw:  # stop at the greedy output's second token, held off until 6 tokens
        free = alone(engine, REPEATS, greedy(12))[0]
        sp = greedy(12, **kw, stop_token_ids=[free[1]])
    want = reference_greedy(engine, REPEATS, sp)
    assert alone(engine, REPEATS, sp)[0] == want
    assert alone(multi_engine, REPEATS, sp)[0] == want
    if "min_tokens" in kw:
        assert len(want) >= 6 and want[:2] != free[:2]


def repeats(tokens):
    return len(tokens) - len(set(tokens))


@pytest.mark.parametrize("kw", [dict(frequency_penalty=1.0), dict(presence_penalty=1.0), dict(repetition_penalty=1.5)])
def test_penalties_reduce_repeats(multi_engine, kw):
    free = alone(multi_engine, REPEATS, greedy(20))[0]
    penalised = alone(multi_engine, REPEATS, greedy(20, **kw))[0]
    assert repeats(free) >= 3 and repeats(penalised) < repeats(free)


def test_logit_bias_forces_and_bans(multi_engine):
    free = alone(multi_engine, REPEATS, greedy(8))[0]
    assert alone(multi_engine, REPEATS, greedy(8, logit_bias={42: 100}))[0] == [42] * 8
    banned = alone(multi_engine, REPEATS, greedy(8, logit_bias={free[0]: -100}))[0]
    assert free[0] not in banned
    # a batch where one row uses a processor and the others do not: the others are unchanged
    got = run(multi_engine, {"b": (REPEATS, greedy(8, logit_bias={42: 100})), "f": (REPEATS, greedy(8))})
    assert got["b"][0] == [42] * 8 and got["f"][0] == free


def test_allowed_token_ids_only(multi_engine):
    sp = SamplingParams(temperature=1.0, seed=5, max_tokens=16, stop_token_ids=[], allowed_token_ids=[9, 99, 199])
    assert set(alone(multi_engine, REPEATS, sp)[0]) <= {9, 99, 199}


def test_min_tokens_holds_off_stop_tokens_and_strings(small_checkpoint, multi_engine):
    free = alone(multi_engine, REPEATS, greedy(12))[0]
    stop_at_first = greedy(12, stop_token_ids=[free[0]])
    assert alone(multi_engine, REPEATS, stop_at_first)[0] == []
    held = alone(multi_engine, REPEATS, greedy(12, stop_token_ids=[free[0]], min_tokens=5))
    assert len(held[0]) >= 5 and free[0] not in held[0][:5]
    e = Engine(small_checkpoint, dtype="float32", progress=False, tokenizer=ByteTokenizer(), **SMALL)
    stop = f"<{free[1]}>"
    assert alone(e, REPEATS, greedy(12, stop=[stop]))[0] == free[:2]
    out = alone(e, REPEATS, greedy(12, stop=[stop], min_tokens=4))
    assert len(out[0]) >= 4 and out[0][:4] == free[:4]


class WordTokenizer(ByteTokenizer):
    """ByteTokenizer with `encode`: '<3><4>' -> [3, 4]."""

    def encode(self, text):
        import re

        return [int(t) for t in re.findall(r"<(\d+)>", text)]


def test_bad_words_single_and_multi_token(small_checkpoint):
    e = Engine(
        small_checkpoint,
        dtype="float32",
        progress=False,
        tokenizer=WordTokenizer(),
        **{**SMALL, "decode_steps_per_call": 3},
    )
    free = alone(e, REPEATS, greedy(12))[0]
    one = alone(e, REPEATS, greedy(12, bad_words=[f"<{free[0]}>"]))[0]
    assert free[0] not in one and one == reference_greedy(e, REPEATS, greedy(12), ((free[0],),))
    # a two-token word: its second token is banned only right after its first
    word = (free[3], free[4])
    two = alone(e, REPEATS, greedy(12, bad_words=[f"<{word[0]}><{word[1]}>"]))[0]
    assert two[:4] == free[:4] and two[4] != free[4]
    assert two == reference_greedy(e, REPEATS, greedy(12), (word,))
    assert all(two[i : i + 2] != list(word) for i in range(len(two) - 1))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(logit_bias={512: 1.0}), "logit_bias: token id 512 is outside the vocabulary"),
        (dict(allowed_token_ids=[1, 600]), "allowed_token_ids: token id 600 is outside the vocabulary"),
        (dict(best_of=2), "best_of=2"),
        (dict(bad_words=["x"]), "bad words need a tokenizer"),
    ],
)
def test_processor_values_beyond_the_engine_are_refused(engine, kw, match):
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", [1, 2, 3], greedy(4, **kw))
    assert not engine.has_unfinished_requests()


def test_processors_survive_preemption(engine):
    """Preempted sequences recompute their prompt and output: the counts are rebuilt the same."""
    ps = prompts(4, 4, 12, seed=11)
    reqs = {f"p{i}": (p, greedy(36 - len(p), frequency_penalty=0.8, repetition_penalty=1.2)) for i, p in enumerate(ps)}
    before = engine.stats().num_preemptions
    together = run(engine, reqs)
    assert engine.stats().num_preemptions > before
    for rid, (p, sp) in reqs.items():
        assert together[rid] == alone(engine, p, sp)


def test_start_up_logs_how_many_requests_of_max_model_len_fit(small_checkpoint, caplog):
    """As vLLM's "maximum concurrency": 12 usable pages of 4 tokens hold 48 tokens, 1.2 requests of 40."""
    with caplog.at_level(logging.INFO, logger="gptoss_jax.runner"):
        Engine(small_checkpoint, dtype="float32", progress=False, warmup=False, **SMALL).close()
    assert (
        "(48 tokens); max_model_len 40, so at most 1.2 requests of that length at once (max_num_seqs 4)" in caplog.text
    )


def test_max_model_len_past_the_cache_names_what_took_it(small_checkpoint):
    """A context the cache cannot hold is refused at start-up, naming the settings that size the pools."""
    with pytest.raises(
        ValueError,
        match=r"max_model_len=60 exceeds .* 48 tokens .*max_num_seqs=4 and a prefill call of max_num_batched_tokens=16",
    ):
        Engine(small_checkpoint, dtype="float32", progress=False, warmup=False, **{**SMALL, "max_model_len": 60})


def test_engine_frees_the_bf16_experts_it_made(caplog):
    """With `kernels.moe_prefill_bf16_experts` an engine given parameters (`loaded`) makes the experts' bf16 copy
    itself (the grouped GEMMs are asked for here, interpreted on the CPU), sizes its KV cache after it, and frees it
    on `close`, leaving the caller's parameters alone (a benchmark runs the next engine on them)."""
    from gptoss_jax import config, random_weights
    from pallas_kernels import KernelConfig

    hf = dict(random_weights.DEMO_CONFIG, vocab_size=512, hidden_size=256, intermediate_size=256, head_dim=64)
    cfg = config.from_hf_dict(hf)
    grouped = dict(impl="pallas", mosaic=True)
    params = random_weights.random_params(cfg, jnp.bfloat16, kernels=KernelConfig(**grouped).for_device())
    kernels = dict(grouped, moe_prefill_bf16_experts=True)
    with caplog.at_level("INFO", logger="pallas_kernels"):
        eng = Engine(loaded=(cfg, params), progress=False, kernels=kernels, **SMALL)
    assert "stored the experts in bf16 for the grouped prefill GEMMs" in caplog.text
    copy = eng.params.layers.experts.gu_bf16
    assert copy.shape == (cfg.num_layers, cfg.num_experts, 2 * cfg.intermediate_size, cfg.hidden_size)
    assert params.layers.experts.gu_bf16 is None
    eng.close()
    assert copy.is_deleted() and eng.params.layers.experts.dn_bf16.is_deleted()
    assert not any(a.is_deleted() for a in jax.tree.leaves(params))
