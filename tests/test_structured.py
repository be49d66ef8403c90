"""Structured outputs (gptoss_jax/structured.py): the constraint's compilation and errors, its harmony state machine
(free reasoning, the budget, the answer under the grammar), the sampler's token mask, the API edge, and offline on
the random demo model, whose free output is noise (the served tests with the openai client: test_server_real.py)."""

import collections
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gptoss_jax import sampling, structured
from gptoss_jax import tokenizer as tokenizer_lib
from gptoss_jax.structured import StructuredOutputsParams as SO
from gptoss_jax.tokenizer import CALL, CHANNEL, END, MESSAGE, RETURN, START

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from test_fuzz_server import CHAT, MSG, RESPONSES, app, assert_api_error  # noqa: E402, F401 - `app` is their fixture

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "user": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 999},
                "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
            },
            "required": ["id", "tags"],
            "additionalProperties": False,
        },
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "ok": {"type": "boolean"},
    },
    "required": ["user", "score", "ok"],
    "additionalProperties": False,
}
ENUMS = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 10},
        "note": {"type": ["string", "null"]},
    },
    "required": ["color", "count"],
}
ARRAYS = {
    "type": "object",
    "properties": {
        "points": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "label": {"type": "string"}},
                "required": ["x", "label"],
            },
        }
    },
    "required": ["points"],
}
SCHEMAS = {"person": PERSON, "nested": NESTED, "enums": ENUMS, "arrays": ARRAYS}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["location", "unit"],
        },
    },
}
ANALYSIS_HEADER = [CHANNEL, structured.ANALYSIS, MESSAGE]


@pytest.fixture(scope="module")
def enc():
    return tokenizer_lib.load()


def answer_json(enc, token_ids):
    """The JSON value of a `<|channel|>final<|message|>...` answer among the generated tokens."""
    text = enc.decode(token_ids)
    assert "<|channel|>final<|message|>" in text, text[-300:]
    return json.loads(text.rsplit("<|channel|>final<|message|>", 1)[1])


# ---- the constraint, without a model ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(json={"type": "object"}, regex="a"), "give one of"),
        (dict(), "no constraint"),
        (dict(json="{not json"), "not valid JSON"),
        (dict(choice=[]), "non-empty list"),
        (dict(choice=["a", 1]), "strings only"),
        (dict(tools=[("f", "not a schema")]), "pair"),
    ],
)
def test_bad_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SO(**kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(json={"type": "foo"}), "Invalid type: foo"),
        (dict(json={"type": "string", "format": "no-such-format"}), "Unknown format"),
        (dict(regex="(ab"), "unclosed group"),
        (dict(grammar="start: missing_rule"), "missing_rule"),
    ],
)
def test_compile_errors_name_the_problem(enc, kwargs, match):
    with pytest.raises(ValueError, match=match):
        structured.compile_grammar(SO(**kwargs), enc)


def test_unknown_keywords_pass_when_not_strict(enc):
    structured.compile_grammar(SO(json={"type": "string", "format": "no-such-format"}, strict=False), enc)


def constraint(enc, so, prompt=(), budget=8, room=1000):
    grammar = structured.compile_grammar(so, enc) if so is not None else None
    return structured.Constraint(grammar, enc, budget, tokenizer_lib.VOCAB_SIZE, [1, *prompt], 1 + len(prompt) + room)


def allowed(c):
    return set(np.nonzero(np.unpackbits(c.mask.view(np.uint8), bitorder="little"))[0].tolist())


def write(enc, c, text: str) -> None:
    """Feed `text` as a model would under `c` (each token allowed by the mask where the row is gated) and take the
    forced tokens as given."""
    while text:
        t = enc.encode_ordinary(text)[0]
        assert not c.gated or t in allowed(c), (text, enc.decode([t]))
        keep, forced = c.accept([t])
        assert keep == 1
        done = enc.decode([t] + forced)
        assert text.startswith(done), (text, done)
        text = text[len(done) :]


def answering(enc, so, text: str):
    """A constraint whose answer (no reasoning) has begun with `text`."""
    c = constraint(enc, so)
    _, forced = c.accept([10])
    write(enc, c, text[len(enc.decode(forced).split("<|message|>")[1]) :])
    return c


def test_reasoning_is_free_then_end_opens_the_constrained_answer(enc):
    c = constraint(enc, SO(choice=["yes", "no"]))
    body = enc.encode_ordinary(" thinking hard")
    assert c.accept(ANALYSIS_HEADER + body) == (3 + len(body), []) and not c.gated  # multi-step, unmasked
    keep, forced = c.accept([END, 99, 98])  # tokens after <|end|> in the same call are dropped
    assert keep == 1 and forced[:2] == [START, structured.ASSISTANT]
    assert enc.decode(forced[2:]) == "<|channel|>final<|message|>"  # the grammar forces the header
    assert c.gated
    options = {enc.decode([t]) for t in allowed(c)}
    assert {"yes", "no"} <= options and all("yes".startswith(o) or "no".startswith(o) for o in options)
    no = enc.encode_ordinary("no")
    assert c.accept(no + [5, 6]) == (1, [])  # a gated call is good for one token
    assert allowed(c) == {RETURN}


def test_budget_and_stray_specials_close_the_reasoning(enc):
    c = constraint(enc, SO(json_object=True), prompt=ANALYSIS_HEADER, budget=3)
    keep, forced = c.accept([10, 11, 12, 13, 14])
    assert keep == 3 and forced[:3] == [END, START, structured.ASSISTANT]
    c = constraint(enc, SO(json_object=True), prompt=ANALYSIS_HEADER)
    keep, forced = c.accept([10, RETURN, 11])  # a stop token inside the reasoning is not an answer
    assert keep == 1 and forced[:3] == [END, START, structured.ASSISTANT]
    c = constraint(enc, SO(json_object=True))
    keep, forced = c.accept([CHANNEL, 10, 11])  # a broken analysis header is completed
    assert (keep, forced) == (1, [structured.ANALYSIS, MESSAGE]) and c.phase == "reasoning"


def test_no_reasoning_starts_the_answer_and_tool_calls_end_in_call(enc):
    c = constraint(enc, SO(tools=[("get_weather", WEATHER["function"]["parameters"])]))
    keep, forced = c.accept([10, 11])
    assert keep == 0 and c.gated
    header = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    text = enc.decode(forced)
    assert text.startswith(header)
    write(enc, c, '{"location":"Paris","unit":"celsius"}'[len(text) - len(header) :])
    assert c.accept([5]) == (0, []) and c.gated and allowed(c) == {CALL}  # a wrong token: dropped, then the mask


def test_near_the_length_limit_the_answer_is_steered_to_its_end(enc):
    c = constraint(enc, SO(json=NESTED), room=40)
    keep, out = c.accept([10])
    rng = np.random.default_rng(0)
    for _ in range(200):
        t = int(rng.choice(sorted(allowed(c)))) if c.gated else int(rng.integers(0, 200_000))  # free: mostly wrong
        keep, forced = c.accept([t])
        out += [t][:keep] + forced
        if keep and t == RETURN:
            break
    assert out[-1] == RETURN and c.length <= c.max_len
    jsonschema.validate(answer_json(enc, out[:-1]), NESTED)


def test_at_the_length_limit_the_closers_are_forced_at_once(enc):
    """Entering the closing reserve forces every closer in one `accept` (fed a token a step), so the row needs only
    its stop token drawn under a mask, not one masked draw a call for each closer."""
    schema = {"type": "object", "properties": {"note": {"type": "array", "items": {"type": "string"}}}}
    c = constraint(enc, SO(json=schema), room=40)
    c.accept([10])
    word = enc.encode_ordinary(" word")[0]
    write(enc, c, '{"note":["')
    out = []
    for _ in range(40):
        keep, forced = c.accept([word])
        out += [word][:keep] + forced
        if forced or c.gated:
            break
    assert keep == 1 and c.max_len - c.length <= structured.CLOSING_RESERVE
    assert enc.decode(forced).replace(" ", "") == '"]}' and c.gated and allowed(c) == {RETURN}
    assert json.loads('{"note":["' + enc.decode(out)) == {"note": [" word" * (len(out) - len(forced))]}


def test_a_held_mask_keeps_string_content_and_drops_what_it_does_not_cover(enc):
    """Inside a JSON string the row's mask holds across content tokens (`Gate`): a token drawn under it is kept only
    where the state's own mask is within it. In an enum's string the content changes the mask, so a token drawn
    under the held one is dropped whatever it is; drawn freely, the same token is kept."""
    c = answering(enc, SO(json=ENUMS), '{"color":"')
    assert c.in_string and c.gate(pending=True, holds=False) is None  # in flight, a mask that does not hold: none
    gate = c.gate(pending=True, holds=True)
    assert gate.holds and gate.position == c.length
    re_, d = enc.encode_ordinary("re") + enc.encode_ordinary("d")
    assert structured._bit(gate.mask, re_) and structured._bit(c.stay, re_)
    keep, forced = c.accept([re_, d], gate)  # "d" was drawn under the mask of the string's start: dropped
    assert keep == 1 and enc.decode(forced).startswith('d","')  # (then forced: the enum allows only "red")
    c = answering(enc, SO(json=ENUMS), '{"color":"')
    assert c.accept([re_, d])[0] == 2  # drawn freely: kept

    c = answering(enc, SO(json=PERSON), '{"name":"')
    gate = c.gate(pending=False, holds=True)
    words = enc.encode_ordinary(" Ada Love")
    assert c.accept(words, gate) == (len(words), []) and not c.gated  # a plain string: its mask does not change
    close, nxt = enc.encode_ordinary('",'), enc.encode_ordinary('"age')[0]
    gate = c.gate(pending=True, holds=True)
    assert c.accept(close + [nxt], gate) == (len(close) + 1, [])  # after the quote the draw is free: kept if valid
    assert gate.applies(c.length - 2, collections.deque(list(c.recent)[:-2]))  # the quote: drawn under the mask
    assert not gate.applies(c.length - 1, collections.deque(list(c.recent)[:-1]))  # after it: drawn freely


def test_the_device_and_the_host_agree_where_a_mask_holds():
    """`sampling.mask_applies` (the device, from the tokens it recorded) and `Gate.applies` (the host, from the tokens
    it kept) decide the same for every row: at the mask's position, across tokens allowed by the mask and in `stay`,
    up to `MAX_HELD` of them, and only where the row's mask holds."""
    rng = np.random.default_rng(0)
    B, V, S = 64, 96, 70
    W, R = structured.mask_words(V), sampling.MAX_BAD_WORD_TOKENS
    pack = lambda bits: np.packbits(bits.reshape(-1, W, 32), axis=-1, bitorder="little").view(np.int32)[..., 0]  # noqa: E731
    stay = pack(np.pad(rng.random(V) < 0.95, (0, W * 32 - V)))[0]
    masks = pack(np.pad(rng.random((B, V)) < 0.95, ((0, 0), (0, W * 32 - V))))
    mask_pos = rng.integers(5, 40, B).astype(np.int32)
    pos = (mask_pos - 1 + rng.integers(-2, structured.MAX_HELD + 3, B)).astype(np.int32)
    holds, masked = rng.random(B) < 0.7, rng.random(B) < 0.9
    pos[:3] = -1  # padding rows
    slots = rng.permutation(S)[:B]
    history = rng.integers(0, V, (B, 64)).astype(np.int32)  # each row's token at every position
    recent = np.zeros((S, R), np.int32)
    for b in range(B):
        for p in range(max(pos[b] - R + 1, 0), pos[b] + 1):
            recent[slots[b], p % R] = history[b, p]
    proc = np.zeros((B, 4), np.int32)
    proc[:, 3] = slots
    sb = sampling.SamplingBatch(
        *(jnp.zeros(B, t) for t in (jnp.float32, jnp.int32, jnp.float32, jnp.float32)),
        jnp.zeros((B, 2), jnp.uint32),
        jnp.zeros(B, bool),
        jnp.asarray(masked),
        jnp.asarray(masks),
        jnp.asarray(mask_pos),
        jnp.asarray(holds),
        jnp.zeros((B, 3), jnp.float32),
        jnp.asarray(proc),
    )
    state = sampling.SamplerState.zeros(S, V).replace(recent_SR=jnp.asarray(recent), stay_W=jnp.asarray(stay))
    device = np.asarray(jax.jit(sampling.mask_applies)(sb, state, jnp.asarray(pos)))
    for b in range(B):
        gate = structured.Gate(masks[b], int(mask_pos[b]), bool(holds[b]), stay)
        before = collections.deque(history[b, : max(pos[b] + 1, 0)].tolist(), maxlen=structured.MAX_HELD)
        host = bool(masked[b]) and pos[b] >= 0 and gate.applies(int(pos[b]) + 1, before)
        assert device[b] == host, b
    assert 10 < device.sum() < B - 10  # both outcomes, many times
    assert any(device[b] and pos[b] + 1 > mask_pos[b] for b in range(B))  # held past the mask's position


def test_stay_tokens_are_whole_characters_of_string_content(enc):
    stay = structured.stay_tokens(enc, tokenizer_lib.VOCAB_SIZE)
    assert all(structured._bit(stay, t) for t in enc.encode_ordinary(" hello world"))
    for text in ('"', '",', "\\n", "\n"):
        assert not any(structured._bit(stay, t) for t in enc.encode_ordinary(text)), text
    assert not structured._bit(stay, enc.encode_single_token(bytes([0xE4]))) and not structured._bit(stay, RETURN)


def test_budget_only_limits_the_reasoning_and_leaves_the_answer_free(enc):
    c = constraint(enc, None, prompt=ANALYSIS_HEADER, budget=2)
    assert c.accept([10, 11, 12]) == (2, [END, START, structured.ASSISTANT])
    assert c.accept([13, 14, RETURN]) == (3, []) and not c.gated


# ---- the sampler's mask ----------------------------------------------------------------------------------------


def test_sampler_draws_only_allowed_tokens_and_leaves_other_rows_alone():
    B, V = 6, 1000
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(B, V)) * 3, jnp.float32)
    allow = rng.random((B, V)) < 0.01
    masked = np.array([True, True, True, False, False, True])
    words = structured.mask_words(V)
    bits = np.zeros((B, words * 32), bool)
    bits[:, :V] = allow
    keys = jnp.asarray(rng.integers(0, 2**31, (B, 2)), jnp.uint32)
    packed = np.packbits(bits.reshape(B, words, 32), axis=-1, bitorder="little").view(np.int32)[..., 0]

    def batch(masked_B):
        return sampling.SamplingBatch(
            jnp.asarray([0.0, 1.0, 2.0, 0.0, 1.0, 1.0], jnp.float32),
            jnp.zeros(B, jnp.int32),
            jnp.asarray([1, 0.9, 1, 1, 1, 1], jnp.float32),
            jnp.zeros(B, jnp.float32),
            keys,
            jnp.zeros(B, bool),
            jnp.asarray(masked_B),
            jnp.asarray(packed),
            jnp.zeros(B, jnp.int32),
            jnp.zeros(B, bool),
            jnp.tile(jnp.asarray([0.0, 0.0, 1.0]), (B, 1)),  # no logits processor
            jnp.zeros((B, 4), jnp.int32),
        )

    sb = batch(masked)
    free = batch(np.zeros(B, bool))
    draw = jax.jit(sampling.sample_batch, static_argnums=3)
    for pos in range(20):
        pos_B = jnp.full(B, pos, jnp.int32)
        got = np.asarray(draw(logits, pos_B, sb, 1).tokens)
        ref = np.asarray(draw(logits, pos_B, free, 1).tokens)
        for b in range(B):
            assert allow[b, got[b]] if masked[b] else got[b] == ref[b]


# ---- offline on the demo model ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from gptoss_jax.llm import LLM

    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPTOSS_JAX_HOME", str(home))
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
            decode_steps_per_call=4,
            warmup=True,
        ) as llm:
            yield llm


@pytest.mark.slow
def test_offline_reasoning_budget_mixed_batch_and_no_compilation(demo):
    """The demo model never closes its reasoning: the budget does, and the answer still validates. An unconstrained
    row beside constrained ones gets exactly its greedy tokens alone (their dropped tokens and rolled-back cache
    positions touch nothing of it); nothing compiles for constraints."""
    from gptoss_jax import steps
    from gptoss_jax.sampling import SamplingParams

    enc = demo.engine.tokenizer
    chat = enc.encode("<|start|>user<|message|>hi<|end|><|start|>assistant", allowed_special="all")
    opened = chat + ANALYSIS_HEADER
    traces = sum(steps.TRACES.values())
    free = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[])
    alone = demo.generate(prompt_token_ids=[opened], sampling_params=free, use_tqdm=False)[0].outputs[0].token_ids
    params = [
        free,
        SamplingParams(
            temperature=1.0, seed=1, max_tokens=40, thinking_token_budget=5, structured_outputs=SO(json=PERSON)
        ),
        SamplingParams(temperature=0.8, seed=2, max_tokens=20, structured_outputs=SO(regex=r"[0-9]{3}-[a-z]{2,4}")),
        SamplingParams(temperature=0, max_tokens=20, thinking_token_budget=4),
    ]
    outs = demo.generate(prompt_token_ids=[opened, opened, chat, opened], sampling_params=params, use_tqdm=False)
    toks = [o.outputs[0].token_ids for o in outs]
    assert toks[0] == alone
    text = enc.decode(toks[1])
    assert len(enc.encode(text.split("<|end|>")[0], allowed_special="all")) == 5  # the budget closed the analysis
    assert text.split("<|end|>", 1)[1].startswith("<|start|>assistant<|channel|>final<|message|>")
    jsonschema.validate(answer_json(enc, toks[1]), PERSON)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", enc.decode(toks[2]).split("<|message|>", 1)[1])
    assert [o.outputs[0].finish_reason for o in outs[1:3]] == ["stop", "stop"]
    text = enc.decode(toks[3])  # a budget alone: the answer after it is free
    assert len(enc.encode(text.split("<|end|>")[0], allowed_special="all")) == 4
    assert text.split("<|end|>", 1)[1].startswith("<|start|>assistant")
    assert sum(steps.TRACES.values()) == traces


ENDLESS = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["tags"],
}


@pytest.mark.slow
def test_answering_rows_join_every_call_and_close_in_time(demo):
    """Structured-output rows writing their answers are in every engine call, beside a free row: with tokens in flight
    they draw freely and the host keeps what the grammar accepts (or voids the call when it rejects one), instead of
    skipping the call after each masked one (which halved their rate under async scheduling). Short `max_tokens`
    make the engine steer the answers to their end: a row that needs that mask voids its calls in flight. Tokens the
    grammar forces (a key, a closing quote) are fed to the decode call, one per step, instead of a prefill call."""
    from gptoss_jax.sampling import SamplingParams

    eng = demo.engine
    assert eng.config.async_scheduling
    opened = eng.tokenizer.encode("<|start|>user<|message|>hi<|end|><|start|>assistant", allowed_special="all")
    for i in range(3):  # no reasoning: the answer starts at once
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=40 + 12 * i, structured_outputs=SO(json=ENDLESS))
        eng.add_request(f"so{i}", opened, params)
    opened += ANALYSIS_HEADER
    eng.add_request("free", opened, SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[]))
    schedule, missed, answering, fed = eng.scheduler.schedule, [], 0, 0
    tokens = {f"so{i}": [] for i in range(3)}
    try:
        while eng.has_unfinished_requests():
            seqs = [eng._requests.get(r) for r in tokens]
            work = schedule()
            for seq in seqs:  # answering: in the decode call (tokens the grammar forced fed to it, not prefilled)
                first, end = seq.decode_span(4) if seq is not None else (0, 0)
                if end > first and seq.constraint.phase == "answer":
                    answering += 1
                    missed.append(seq not in work.decodes)
                    fed += seq.fed_tokens > 1
            eng.scheduler.schedule = lambda drafts=True, w=work: w  # this step runs the work just inspected
            for o in eng.step():
                tokens.get(o.request_id, []).extend(o.new_token_ids)
    finally:
        del eng.scheduler.schedule  # the method again
    for ids in tokens.values():
        jsonschema.validate(answer_json(eng.tokenizer, ids), ENDLESS)
    assert answering > 10 and fed > 0 and not any(missed), missed


LOWERCASE = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^[a-z ]*$"}}, "required": ["s"]}


@pytest.mark.slow
def test_a_string_is_written_at_nearly_a_token_a_step(demo):
    """Inside a JSON string the mask holds at a call's later steps and across the tokens in flight (`structured.Gate`,
    `sampling.mask_applies`). The random model's free draws would mostly break this string's pattern, each rejection
    voiding the row's call in flight; drawn under the held mask, its tokens come nearly as fast as a free row's."""
    from gptoss_jax.sampling import SamplingParams

    eng = demo.engine
    opened = eng.tokenizer.encode("<|start|>user<|message|>hi<|end|><|start|>assistant", allowed_special="all")
    runs = {}
    for name, so in (("free", None), ("string", SO(json=LOWERCASE))):
        stops = {} if so else {"stop_token_ids": []}
        sp = SamplingParams(temperature=1.0, seed=3, max_tokens=96, structured_outputs=so, **stops)
        eng.add_request(name, opened, sp)
        steps, ids = 0, []
        while eng.has_unfinished_requests():
            steps += 1
            ids += [t for o in eng.step() for t in o.new_token_ids]
        runs[name] = steps, ids
    jsonschema.validate(answer_json(eng.tokenizer, runs["string"][1]), LOWERCASE)
    assert len(runs["string"][1]) > 60 and runs["string"][0] <= runs["free"][0] + 6, runs


# ---- the API edge (in process, the scripted engine) --------------------------------------------------------------


@pytest.mark.parametrize(
    "path,body,param,words",
    [
        (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}}, None, "foo"),
        (CHAT, {"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex", "unclosed group"),
        (CHAT, {"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "guided_json", "nope"),
        (CHAT, {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, None, "'x'"),
        (RESPONSES, {"text": {"format": {"type": "json_schema", "name": "p", "schema": {"type": "bad"}}}}, None, "bad"),
    ],
)
def test_invalid_constraints_are_400s_naming_the_problem(app, path, body, param, words):  # noqa: F811
    base = {"messages": MSG} if path == CHAT else {"input": "hi"}
    err = assert_api_error(app.post(path, {**base, **body}), 400)
    assert words in err["message"] and (param is None or err["param"] == param), err


def test_constrained_requests_reach_the_engine(app):  # noqa: F811
    """The scripted engine ignores the mask; what matters here is the request it receives."""
    seen = []
    add = app.scripted.add_request
    app.scripted.add_request = lambda rid, ids, sp: (seen.append(sp), add(rid, ids, sp))[1]
    try:
        r = app.post(CHAT, {"messages": MSG, "tools": [WEATHER], "tool_choice": "required", "thinking_token_budget": 9})
        assert r.status_code == 200, r.text
        r = app.post(RESPONSES, {"input": "hi", "text": {"format": {"type": "json_object"}}})
        assert r.status_code == 200 and r.json()["text"]["format"] == {"type": "json_object"}, r.text
    finally:
        app.scripted.add_request = add
    assert seen[0].structured_outputs.tools == (("get_weather", WEATHER["function"]["parameters"]),)
    assert seen[0].thinking_token_budget == 9
    assert seen[1].structured_outputs.json_object
