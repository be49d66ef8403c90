"""The real HTTP server driven with the official openai client, behind a scripted engine.

The engine (tests/scripted_engine.py) replays harmony token sequences chosen by a marker in the
prompt, so the parser, SSE streaming, tool calls, usage and every error path are exercised end to
end exactly as a gpt-oss checkpoint would drive them.
"""

import concurrent.futures
import json
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("openai_harmony")
pytest.importorskip("starlette")

from server_utils import REPO, Server, collect_chat_stream  # noqa: E402

from gptoss_jax import tokenizer as tokenizer_lib  # noqa: E402

KEY = "sk-test-123"
WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["location"],
            },
        },
    }
]
SCRIPTS = ["default", "reasoning", "tool", "preamble_tool", "after_tool", "unicode", "malformed", "headerless"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    s = Server(
        [
            "--test-engine",
            str(REPO / "tests" / "scripted_engine.py") + ":make_engine",
            "--api-key",
            KEY,
            "--max-body-bytes",
            "200000",
        ],
        log_path=log,
        timeout=60,
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)


def ask(script):
    return [{"role": "user", "content": f"Please answer. [[script:{script}]]"}]


def nonstream_view(resp):
    out = {}
    for ch in resp.choices:
        m = ch.message
        extra = m.model_extra or {}
        out[ch.index] = {
            "content": m.content or "",
            "reasoning": extra.get("reasoning_content") or "",
            "tools": {
                i: {"name": t.function.name, "arguments": t.function.arguments}
                for i, t in enumerate(m.tool_calls or [])
            },
            "finish_reason": ch.finish_reason,
        }
    return out


def stream_view(collected):
    return {
        i: {
            "content": c["content"],
            "reasoning": c["reasoning"],
            "tools": {k: {"name": t["name"], "arguments": t["arguments"]} for k, t in c["tools"].items()},
            "finish_reason": c["finish_reason"],
        }
        for i, c in collected["choices"].items()
    }


def assert_no_control_tokens(view):
    assert "<|" not in json.dumps(view, ensure_ascii=False)


# ---- basics -------------------------------------------------------------------------------------


def test_health_models_metrics(server, client):
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed
    models = client.models.list()
    assert [m.id for m in models.data] == ["gpt-oss-demo"]
    m = server.metrics()
    for name in (
        "gptoss:num_requests_running",
        "gptoss:num_requests_waiting",
        "gptoss:kv_cache_usage_perc",
        "gptoss:prompt_tokens_total",
        "gptoss:generation_tokens_total",
        "gptoss:num_preemptions_total",
        "gptoss:time_to_first_token_seconds_count",
        "gptoss:inter_token_latency_seconds_count",
        "gptoss:e2e_request_latency_seconds_count",
    ):
        assert name in m, name


def test_reasoning_split_and_usage(client):
    r = client.chat.completions.create(model="gpt-oss-demo", messages=ask("reasoning"), reasoning_effort="high")
    msg = r.choices[0].message
    assert msg.content == "The answer is 4."
    assert msg.model_extra["reasoning_content"] == "The user asks 2+2. That is 4."
    assert msg.model_extra["reasoning"] == msg.model_extra["reasoning_content"]
    assert r.choices[0].finish_reason == "stop"
    u = r.usage
    assert 0 < u.completion_tokens_details.reasoning_tokens < u.completion_tokens
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens and u.prompt_tokens > 20


@pytest.mark.parametrize("script", SCRIPTS)
def test_stream_equals_nonstream(client, script):
    kw = dict(model="gpt-oss-demo", messages=ask(script), tools=WEATHER)
    full = nonstream_view(client.chat.completions.create(**kw))
    streamed = collect_chat_stream(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert stream_view(streamed) == full
    assert streamed["usage"] is not None and streamed["usage"].completion_tokens > 0
    assert_no_control_tokens(full)


def test_malformed_and_headerless_degrade_to_content(client):
    r = client.chat.completions.create(model="gpt-oss-demo", messages=ask("malformed"))
    assert r.choices[0].message.content == "stray textok!"
    assert r.choices[0].message.model_extra["reasoning_content"] == "hmm"
    r = client.chat.completions.create(model="gpt-oss-demo", messages=ask("headerless"))
    assert r.choices[0].message.content == "I cannot help with that."


def test_unicode_survives_token_splits(client):
    r = client.chat.completions.create(model="gpt-oss-demo", messages=ask("unicode"))
    assert r.choices[0].message.content == "héllo 世界 🌍🎉 naïve café"
    assert r.choices[0].message.model_extra["reasoning_content"] == "Ünïcödé thoughts 思考 🤔"


def test_length_mid_reasoning_returns_reasoning_and_empty_content(client):
    r = client.chat.completions.create(model="gpt-oss-demo", messages=ask("length"), max_completion_tokens=20)
    ch = r.choices[0]
    assert ch.finish_reason == "length" and ch.message.content == ""
    assert ch.message.model_extra["reasoning_content"].startswith("thinking thinking")
    assert r.usage.completion_tokens == 20


# ---- tools --------------------------------------------------------------------------------------


def test_tool_round_trip(client):
    messages = [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Paris? [[script:tool]]"},
    ]
    r = client.chat.completions.create(model="gpt-oss-demo", messages=messages, tools=WEATHER)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"location": "Paris", "unit": "celsius"}
    messages.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call.model_dump()],
            "reasoning_content": ch.message.model_extra["reasoning_content"],
        }
    )
    messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"} [[script:after_tool]]'})
    r2 = client.chat.completions.create(model="gpt-oss-demo", messages=messages, tools=WEATHER)
    assert r2.choices[0].message.content == "It is sunny in Paris, 21 °C."
    assert r2.choices[0].finish_reason == "stop"
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens + r.usage.completion_tokens - 10


def test_preamble_and_streamed_tool_call_shape(client):
    got = collect_chat_stream(
        client.chat.completions.create(model="gpt-oss-demo", messages=ask("preamble_tool"), tools=WEATHER, stream=True)
    )
    c = got["choices"][0]
    assert c["content"] == "Let me check the weather." and c["finish_reason"] == "tool_calls"
    assert c["tools"][0]["name"] == "get_weather" and json.loads(c["tools"][0]["arguments"]) == {"location": "Tokyo"}
    assert c["tools"][0]["id"].startswith("call_")


# ---- request options ----------------------------------------------------------------------------


def test_n_choices(client):
    kw = dict(model="gpt-oss-demo", messages=ask("reasoning"), n=3, seed=7)
    full = nonstream_view(client.chat.completions.create(**kw))
    assert sorted(full) == [0, 1, 2] and all(v["content"] == "The answer is 4." for v in full.values())
    streamed = collect_chat_stream(client.chat.completions.create(stream=True, **kw))
    assert stream_view(streamed) == full


def test_stop_strings_apply_to_content_only(client):
    kw = dict(model="gpt-oss-demo", messages=ask("stopword"), stop=["STOP"])
    full = nonstream_view(client.chat.completions.create(**kw))
    assert full[0]["content"] == "one two " and full[0]["finish_reason"] == "stop"
    assert full[0]["reasoning"] == "STOP in reasoning is fine"
    assert stream_view(collect_chat_stream(client.chat.completions.create(stream=True, **kw))) == full


def _tokens_through(text: str, stop: str) -> int:
    """How many tokens of `text` (o200k, special tokens allowed) it takes for the prefix's text (special tokens
    left out) to contain `stop`."""
    tok = tokenizer_lib.load()
    ids = tok.encode(text, allowed_special="all")
    return next(n for n in range(1, len(ids) + 1) if stop in tok.decode([t for t in ids[:n] if t < 199998]))


@pytest.mark.parametrize("max_tokens", [None, 12])
def test_stop_inside_the_held_back_header_reports_stop_and_true_usage(client, max_tokens):
    # "headerless": plain text that the parser holds back as a possible header (up to 48 tokens); a stop string
    # in it must end the choice with "stop" and the usage must count the tokens up to the stop, whether the engine
    # ended by length before the text was released (max_tokens=12) or by its stop token
    text = "I cannot help with that."
    kw = dict(model="gpt-oss-demo", messages=ask("headerless"), stop=["help"], max_tokens=max_tokens)
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.content == "I cannot " and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == _tokens_through(text, "help")
    got = collect_chat_stream(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert stream_view(got) == nonstream_view(r) and got["usage"].completion_tokens == r.usage.completion_tokens
    # a stop token inside the header: "stop" and every token counted once
    r = client.chat.completions.create(model="gpt-oss-demo", messages=ask("headerless"))
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == text
    assert r.usage.completion_tokens == len(tokenizer_lib.load().encode(text))


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_of_held_back_header_tokens_arrive_in_order(client, stream):
    text = "I cannot help with that."
    kw = dict(model="gpt-oss-demo", messages=ask("headerless"), logprobs=True, top_logprobs=1)
    if stream:
        got = collect_chat_stream(client.chat.completions.create(stream=True, **kw))["choices"][0]
        content, lps = got["content"], got["logprobs"]
    else:
        ch = client.chat.completions.create(**kw).choices[0]
        content, lps = ch.message.content, ch.logprobs.content
    tok = tokenizer_lib.load()
    assert content == text
    assert [x.token for x in lps] == [tok.decode([t]) for t in tok.encode(text)]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_stop_in_the_first_tokens(client, stream):
    kw = dict(model="gpt-oss-demo", prompt="Count [[count:6]]", max_tokens=100, stop=[" t1"], logprobs=0)
    if stream:
        chunks = [c for c in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        usage = chunks[-1].usage
        tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    else:
        r = client.completions.create(**kw)
        text, finish, usage, tokens = (
            r.choices[0].text,
            [r.choices[0].finish_reason],
            r.usage,
            r.choices[0].logprobs.tokens,
        )
    assert text == "final t0" and finish == ["stop"]
    assert usage.completion_tokens == _tokens_through("<|channel|>final<|message|> t0 t1", " t1")
    assert "".join(tokens).startswith(text)


def test_logprobs(client):
    kw = dict(model="gpt-oss-demo", messages=ask("default"), logprobs=True, top_logprobs=2)
    r = client.chat.completions.create(**kw)
    lps = r.choices[0].logprobs.content
    assert "".join(x.token for x in lps) == r.choices[0].message.content
    assert all(len(x.top_logprobs) == 2 for x in lps)
    streamed = collect_chat_stream(client.chat.completions.create(stream=True, **kw))
    assert [x.token for x in streamed["choices"][0]["logprobs"]] == [x.token for x in lps]


def test_sampling_fields_accepted(client):
    r = client.chat.completions.create(
        model="gpt-oss-demo",
        messages=ask("default"),
        temperature=0.7,
        top_p=0.9,
        seed=3,
        max_tokens=50,
        extra_body={"top_k": 20, "min_p": 0.05},
    )
    assert r.choices[0].message.content == "Hello from the scripted engine."
    for effort_kw in (
        {"reasoning_effort": "low"},
        {"extra_body": {"chat_template_kwargs": {"reasoning_effort": "high"}}},
        {"extra_body": {"reasoning": {"effort": "medium"}}},
    ):
        client.chat.completions.create(model="gpt-oss-demo", messages=ask("default"), **effort_kw)


def test_completions(client):
    r = client.completions.create(model="gpt-oss-demo", prompt="Count [[count:6]]", max_tokens=100)
    # raw completion: no harmony parsing, control tokens skipped, the channel name is plain text
    assert r.choices[0].text == "final t0 t1 t2 t3 t4 t5" and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > 6
    chunks = list(
        client.completions.create(model="gpt-oss-demo", prompt="Count [[count:6]]", max_tokens=100, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"
    r = client.completions.create(model="gpt-oss-demo", prompt="x [[count:3]]", max_tokens=4, logprobs=1)
    assert r.choices[0].finish_reason == "length"
    assert "".join(r.choices[0].logprobs.tokens) == r.choices[0].text  # control tokens are skipped
    assert "<|" not in r.choices[0].text
    ids = httpx.post(
        client.base_url.join("completions").__str__(),
        headers={"Authorization": f"Bearer {KEY}"},
        json={"prompt": [200006, 1428, 200008, 77, 200007], "max_tokens": 3},
    ).json()
    assert ids["usage"]["prompt_tokens"] == 5


def test_responses_api(client):
    r = client.responses.create(
        model="gpt-oss-demo", input="2+2? [[script:reasoning]]", reasoning={"effort": "low"}, instructions="Be brief."
    )
    kinds = [o.type for o in r.output]
    assert kinds == ["reasoning", "message"]
    assert r.output_text == "The answer is 4."
    assert r.output[0].content[0].text == "The user asks 2+2. That is 4."
    assert r.usage.output_tokens_details.reasoning_tokens > 0 and r.status == "completed"
    events = list(client.responses.create(model="gpt-oss-demo", input="2+2? [[script:reasoning]]", stream=True))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "The answer is 4."
    assert (
        "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "The user asks 2+2. That is 4."
    )
    assert events[-1].response.output_text == "The answer is 4."


def test_responses_function_call_round_trip(client):
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "weather",
            "parameters": WEATHER[0]["function"]["parameters"],
        }
    ]
    r = client.responses.create(model="gpt-oss-demo", input="Paris? [[script:tool]]", tools=tools)
    call = [o for o in r.output if o.type == "function_call"][0]
    assert call.name == "get_weather" and json.loads(call.arguments)["location"] == "Paris"
    events = list(
        client.responses.create(model="gpt-oss-demo", input="Paris? [[script:tool]]", tools=tools, stream=True)
    )
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments
    follow = [
        {"role": "user", "content": "Paris? [[script:tool]]"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny [[script:after_tool]]"},
    ]
    r2 = client.responses.create(model="gpt-oss-demo", input=follow, tools=tools)
    assert r2.output_text == "It is sunny in Paris, 21 °C."


# ---- errors ---------------------------------------------------------------------------------------


def post(server, path, body=None, raw=None, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        headers["Content-Type"] = "application/json"
        return httpx.post(server.url + path, content=raw, headers=headers, timeout=30, **kw)
    return httpx.post(server.url + path, json=body, headers=headers, timeout=30, **kw)


def assert_error(resp, status, param=None, contains=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param
    if contains is not None:
        assert contains in err["message"]
    return err


def test_error_cases(server, client):
    chat = "/v1/chat/completions"
    msgs = ask("default")
    assert_error(post(server, chat, raw=b'{"messages": [}'), 400, contains="JSON")
    assert_error(post(server, chat, raw=b"[1, 2]"), 400)
    assert_error(post(server, chat, {"messages": msgs, "temperature": "hot"}), 400, param="temperature")
    assert_error(post(server, chat, {"messages": msgs, "max_tokens": 0}), 400, param="max_tokens")
    assert_error(post(server, chat, {"messages": msgs, "n": 1000}), 400, param="n")
    assert_error(post(server, chat, {"messages": "hi"}), 400, param="messages")
    assert_error(post(server, chat, {}), 400, param="messages")
    assert_error(post(server, chat, {"messages": [{"role": "wizard", "content": "x"}]}), 400)
    assert_error(
        post(
            server,
            chat,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
        ),
        400,
    )
    assert_error(post(server, chat, {"messages": msgs, "reasoning_effort": "extreme"}), 400, param="reasoning_effort")
    assert_error(post(server, chat, {"messages": msgs, "chat_template_kwargs": {"reasoning_effort": "max"}}), 400)
    assert_error(
        post(
            server,
            chat,
            {"messages": msgs, "tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": WEATHER},
        ),
        400,
        param="tool_choice",
    )
    err = assert_error(post(server, chat, {"model": "gpt-5", "messages": msgs}), 404, param="model")
    assert err["code"] == "model_not_found"
    assert_error(post(server, chat, raw=b'{"messages": "' + b"a" * 300000 + b'"}'), 413)
    assert_error(httpx.get(server.url + "/v1/nope"), 404)
    assert_error(httpx.get(server.url + chat), 405)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="gpt-oss-demo", messages=msgs, temperature=5)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=msgs)


def test_context_overflow_is_a_400_not_truncation(server, client):
    long = [{"role": "user", "content": "word " * 5000}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="gpt-oss-demo", messages=long)
    assert "maximum context length is 4096 tokens" in str(e.value)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match=r"you requested \d+ tokens \(\d+ in the messages, 4090 in"):
        client.chat.completions.create(model="gpt-oss-demo", messages=ask("default"), max_tokens=4090)
    assert_error(post(server, "/v1/completions", {"prompt": "w " * 5000}), 400, param="prompt")
    assert_error(post(server, "/v1/responses", {"input": "w " * 5000}), 400, param="input")


def test_auth(server):
    body = {"messages": ask("default")}
    assert_error(post(server, "/v1/chat/completions", body, key=None), 401)
    assert_error(post(server, "/v1/chat/completions", body, key="wrong"), 401)
    assert httpx.get(server.url + "/v1/models").status_code == 401
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="gpt-oss-demo", messages=ask("default"))
    assert post(server, "/v1/chat/completions", body).status_code == 200


# ---- disconnects and concurrency ------------------------------------------------------------------


def wait_idle(server, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = server.metrics()
        if m["gptoss:num_requests_running"] == 0 and m["gptoss:kv_cache_usage_perc"] == 0:
            return m
        time.sleep(0.05)
    raise AssertionError(f"engine not idle: {server.metrics()}")


def test_disconnect_aborts_and_frees_pages(server):
    wait_idle(server)
    before = server.metrics()["gptoss:num_aborted_requests_total"]
    body = {"messages": [{"role": "user", "content": "go [[slow:x]]"}], "max_tokens": 3900, "stream": True}
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    ) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        m = server.metrics()
        assert m["gptoss:num_requests_running"] == 1 and m["gptoss:kv_cache_usage_perc"] > 0
    # the client closed the stream long before 3900 tokens
    m = wait_idle(server)
    assert m["gptoss:num_aborted_requests_total"] == before + 1
    # non-streaming: the client gives up (timeout) and the server aborts too
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            server.url + "/v1/chat/completions",
            json=dict(body, stream=False),
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=0.5,
        )
    m = wait_idle(server)
    assert m["gptoss:num_aborted_requests_total"] == before + 2


def test_32_concurrent_streams_no_lost_or_duplicated_tokens(server, client):
    wait_idle(server)

    def one(i):
        n = 40 + i
        got = collect_chat_stream(
            client.chat.completions.create(
                model="gpt-oss-demo",
                messages=[{"role": "user", "content": f"[[count:{n}]]"}],
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        return n, got

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    for n, got in results:
        c = got["choices"][0]
        assert c["content"] == "".join(f" t{i}" for i in range(n))
        assert c["finish_reason"] == "stop" and c["roles"] == 1
    wait_idle(server)


def test_bench_serving_tool(server, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    for endpoint in ("chat", "completions"):
        r = subprocess.run(
            [
                sys.executable,
                str(REPO / "tools" / "bench_serving.py"),
                "--base-url",
                server.url,
                "--api-key",
                KEY,
                "--num-prompts",
                "12",
                "--concurrency",
                "4",
                "--input-len",
                "64",
                "--output-len",
                "16",
                "--request-rate",
                "50",
                "--endpoint",
                endpoint,
                "--json",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        res = json.loads(out.read_text())
        assert res["completed"] == 12 and res["failed"] == 0 and res["total_output_tokens"] > 0
        assert res["ttft_s"]["p99"] is not None and res["itl_s"]["p50"] is not None
        assert "TTFT" in r.stdout and "ITL" in r.stdout


def test_health_reports_loading_progress(tmp_path):
    """While the engine loads, /health is a 503 saying where loading stands (stage, fraction, what), then 200."""
    seen = []
    s = Server(
        ["--test-engine", str(REPO / "tests" / "scripted_engine.py") + ":make_slow_engine", "--no-warmup"],
        log_path=tmp_path / "server.log",
        timeout=60,
        on_health=lambda r: seen.append((r.status_code, r.json())),
    )
    s.stop()
    loading = [body for code, body in seen if code == 503]
    assert loading and all(body["status"] == "loading" for body in loading)
    compiling = [body for body in loading if body["stage"] == "compiling"]
    assert compiling and all(0 < body["progress"] <= 1 for body in compiling)
    assert all(body["detail"].startswith("decode rows=") for body in compiling)
    assert sorted(body["progress"] for body in compiling) == [body["progress"] for body in compiling]
    assert seen[-1] == (200, {"status": "ok"})


# ---- sampling parameters (the engine's processors are tested in test_engine/test_sampling) ------------------------


def echo(client, **kw):
    r = client.chat.completions.create(
        model="gpt-oss-demo", messages=[{"role": "user", "content": "[[echo:params]]"}], max_tokens=200, **kw
    )
    return json.loads(r.choices[0].message.content)


def test_sampling_parameters_reach_the_engine(client):
    got = echo(
        client,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        logit_bias={"1000": 100, " 17": -5.5},
        extra_body={
            "repetition_penalty": 1.2,
            "min_tokens": 3,
            "ignore_eos": True,
            "bad_words": ["foo", "bar baz"],
            "allowed_token_ids": [5, 6, 7],
            "stop_token_ids": [42],
        },
    )
    assert got == {
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "repetition_penalty": 1.2,
        "min_tokens": 3,
        "ignore_eos": True,
        "bad_words": ["foo", "bar baz"],
        "allowed_token_ids": [5, 6, 7],
        "stop_token_ids": [200002, 200012, 199999, 42],
        "n": 1,
        "logit_bias": {"1000": 100.0, "17": -5.5},
    }
    r = client.completions.create(
        model="gpt-oss-demo", prompt="[[echo:params]]", max_tokens=300, presence_penalty=1, extra_body={"min_tokens": 2}
    )
    assert json.loads(r.choices[0].text.removeprefix("final"))["presence_penalty"] == 1.0


def test_min_tokens_holds_off_stop_strings(client):
    kw = dict(model="gpt-oss-demo", prompt="Count [[count:6]]", max_tokens=100, stop=[" t1"])
    assert client.completions.create(**kw).choices[0].text == "final t0"
    r = client.completions.create(**kw, extra_body={"min_tokens": 40})
    assert r.choices[0].text == "final t0 t1 t2 t3 t4 t5" and r.choices[0].finish_reason == "stop"
    got = collect_chat_stream(
        client.chat.completions.create(
            model="gpt-oss-demo", messages=ask("stopword"), stop=["STOP"], stream=True, extra_body={"min_tokens": 200}
        )
    )
    assert got["choices"][0]["content"] == "one two STOP three four"


def test_legacy_functions_map_onto_tools(client):
    functions = [WEATHER[0]["function"]]
    r = client.chat.completions.create(
        model="gpt-oss-demo", messages=ask("tool"), functions=functions, function_call="auto"
    )
    ch = r.choices[0]
    assert ch.finish_reason == "function_call" and ch.message.tool_calls is None
    assert ch.message.function_call.name == "get_weather"
    assert json.loads(ch.message.function_call.arguments) == {"location": "Paris", "unit": "celsius"}
    chunks = list(
        client.chat.completions.create(
            model="gpt-oss-demo",
            messages=ask("tool"),
            functions=functions,
            function_call={"name": "get_weather"},
            stream=True,
        )
    )
    calls = [c.choices[0].delta.function_call for c in chunks if c.choices and c.choices[0].delta.function_call]
    assert (
        calls[0].name == "get_weather"
        and "".join(c.arguments or "" for c in calls) == ch.message.function_call.arguments
    )
    assert chunks[-1].choices[0].finish_reason == "function_call"


def test_best_of_picks_n_choices(client):
    r = client.completions.create(model="gpt-oss-demo", prompt="x [[count:3]]", max_tokens=50, n=2, best_of=3)
    assert [c.index for c in r.choices] == [0, 1] and all(c.text == "final t0 t1 t2" for c in r.choices)
    assert r.choices[0].logprobs is None
    assert r.usage.completion_tokens == 3 * (r.usage.completion_tokens // 3)  # every candidate counted


@pytest.mark.parametrize(
    "endpoint, body, param, match",
    [
        ("chat", {"presence_penalty": 2.5}, "presence_penalty", "presence_penalty"),
        ("chat", {"frequency_penalty": -3}, "frequency_penalty", "frequency_penalty"),
        ("chat", {"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty"),
        ("chat", {"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
        ("chat", {"logit_bias": {"201088": 1}}, "logit_bias", "Token id 201088"),
        ("chat", {"logit_bias": {"5": 101}}, "logit_bias", r"\[-100, 100\]"),
        ("chat", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300"),
        ("chat", {"min_tokens": -1}, "min_tokens", "min_tokens"),
        ("chat", {"min_tokens": 9, "max_tokens": 8}, "min_tokens", "min_tokens"),
        ("chat", {"ignore_eos": "yes"}, "ignore_eos", "ignore_eos"),
        ("chat", {"bad_words": "foo"}, "bad_words", "bad_words"),
        ("chat", {"bad_words": ["w"] * 33}, "bad_words", "at most 32"),
        ("chat", {"allowed_token_ids": [1, 300000]}, "allowed_token_ids", "Token id 300000"),
        ("chat", {"allowed_token_ids": list(range(1025))}, "allowed_token_ids", "at most 1024"),
        ("chat", {"stop_token_ids": [-1]}, "stop_token_ids", "Token id -1"),
        ("chat", {"n": 3, "best_of": 2}, "best_of", "at least 'n'"),
        ("chat", {"best_of": 2, "stream": True}, "best_of", "cannot be streamed"),
        ("completions", {"best_of": 17}, "best_of", "best_of"),
        ("chat", {"use_beam_search": True}, "use_beam_search", "not supported"),
        ("chat", {"length_penalty": 0.5}, "length_penalty", "not supported"),
        ("chat", {"include_stop_str_in_output": True}, "include_stop_str_in_output", "not supported"),
        ("chat", {"skip_special_tokens": False}, "skip_special_tokens", "not supported"),
        ("completions", {"prompt_logprobs": 1}, "prompt_logprobs", "not supported"),
        ("completions", {"truncate_prompt_tokens": 5}, "truncate_prompt_tokens", "not supported"),
        ("chat", {"prediction": {"type": "content", "content": "x"}}, "prediction", "not supported"),
        ("chat", {"add_generation_prompt": False}, "add_generation_prompt", "not supported"),
        ("chat", {"functions": [WEATHER[0]["function"]], "tools": WEATHER}, "functions", "not both"),
        ("chat", {"function_call": "auto"}, "function_call", "needs 'functions'"),
        ("responses", {"background": True}, "background", "not supported"),
        ("responses", {"truncation": "auto"}, "truncation", "not supported"),
        ("responses", {"top_logprobs": 3}, "top_logprobs", "not supported"),
    ],
)
def test_sampling_parameter_errors(server, endpoint, body, param, match):
    url, base = {
        "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        "completions": ("/v1/completions", {"prompt": "hi"}),
        "responses": ("/v1/responses", {"input": "hi"}),
    }[endpoint]
    r = httpx.post(server.url + url, json={**base, **body}, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    import re

    assert re.search(match, err["message"]), err["message"]


def test_off_values_of_unsupported_parameters_are_accepted(client):
    r = client.chat.completions.create(
        model="gpt-oss-demo",
        messages=ask("default"),
        extra_body={"use_beam_search": False, "skip_special_tokens": True, "length_penalty": 1.0, "best_of": 1},
    )
    assert r.choices[0].message.content == "Hello from the scripted engine."


# ---- tokenize, detokenize, models/{id}, version, stored responses ---------------------------------------------


def test_tokenize_and_detokenize(server, client):
    tok = tokenizer_lib.load()
    r = post(server, "/tokenize", {"model": "gpt-oss-demo", "prompt": "Hello world<|end|>", "return_token_strs": True})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == tok.encode("Hello world<|end|>", allowed_special="all") and body["count"] == 3
    assert body["max_model_len"] == 4096 and body["token_strs"] == ["Hello", " world", "<|end|>"]
    assert post(server, "/detokenize", {"tokens": body["tokens"]}).json() == {"prompt": "Hello world<|end|>"}
    # messages: the prompt /v1/chat/completions runs (its usage counts it)
    msgs = [{"role": "user", "content": "Please answer. [[script:default]]"}]
    chat = post(server, "/tokenize", {"messages": msgs}).json()
    usage = client.chat.completions.create(model="gpt-oss-demo", messages=msgs).usage
    assert chat["count"] == usage.prompt_tokens and chat["tokens"][-2:] == [200006, 173781]
    bare = post(server, "/tokenize", {"messages": msgs, "add_generation_prompt": False}).json()
    assert bare["tokens"] == chat["tokens"][:-2] and bare["token_strs"] is None
    for path, body, param in [
        ("/tokenize", {"prompt": "a", "messages": msgs}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "nope"}, "model"),
        ("/detokenize", {"tokens": [1, 201088]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ]:
        r = post(server, path, body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (path, body, r.text)


def test_model_by_id_and_version(server, client):
    m = client.models.retrieve("gpt-oss-demo")
    assert m.id == "gpt-oss-demo" and m.model_extra["max_model_len"] == 4096
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found"
    v = httpx.get(server.url + "/version").json()
    assert set(v) == {"version"} and v["version"]


def test_stored_responses_and_previous_response_id(server, client):
    first = client.responses.create(model="gpt-oss-demo", input="2+2? [[script:reasoning]]")
    assert first.store is True
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == "The answer is 4."
    # the follow-up renders the earlier input and output before its own input
    follow = client.responses.create(
        model="gpt-oss-demo", input="And 3+3? [[script:default]]", previous_response_id=first.id
    )
    assert follow.previous_response_id == first.id and follow.output_text == "Hello from the scripted engine."
    alone = client.responses.create(model="gpt-oss-demo", input="And 3+3? [[script:default]]")
    assert follow.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens // 2
    # store=false keeps nothing; unknown ids are 404 (GET) and 400 (previous_response_id)
    unstored = client.responses.create(model="gpt-oss-demo", input="hi", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="gpt-oss-demo", input="x", previous_response_id=unstored.id)
    assert e.value.body["code"] == "previous_response_not_found" and e.value.body["param"] == "previous_response_id"
    # streamed responses are stored too; DELETE removes one
    events = list(client.responses.create(model="gpt-oss-demo", input="[[script:default]]", stream=True))
    rid = events[-1].response.id
    assert client.responses.retrieve(rid).output_text == "Hello from the scripted engine."
    r = httpx.delete(server.url + f"/v1/responses/{rid}", headers={"Authorization": f"Bearer {KEY}"})
    assert r.json() == {"id": rid, "object": "response", "deleted": True}
    assert httpx.get(server.url + f"/v1/responses/{rid}", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404


def test_response_store_evicts_the_least_recently_used():
    from gptoss_jax.server.app import ResponseStore

    store = ResponseStore(2)
    store.put("a", {"n": 1})
    store.put("b", {"n": 2})
    assert store.get("a") == {"n": 1}  # now the most recently used
    store.put("c", {"n": 3})
    assert store.get("b") is None and store.get("a") and store.get("c")
    assert store.delete("a") and not store.delete("a")
    none = ResponseStore(0)
    none.put("x", {})
    assert none.get("x") is None
