"""The OpenAI-compatible HTTP app (Starlette): chat completions, completions, responses, models,
health and metrics.

Every generation path goes engine outputs -> per-choice `ChoiceRun` (harmony parser, stop strings,
logprobs) -> events. Non-streaming responses are assembled from the same events the SSE stream
sends, so the concatenated stream equals the non-streamed response.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hmac
import importlib.metadata
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from gptoss_jax import harmony, sampling, structured
from gptoss_jax import tokenizer as tokenizer_lib
from gptoss_jax.async_engine import AsyncEngine, EngineDeadError, RequestFailedError, stats_dict
from gptoss_jax.sampling import SamplingParams
from gptoss_jax.server import protocol as P
from gptoss_jax.server.metrics import Metrics
from gptoss_jax.server.sse import SSEResponse

log = logging.getLogger("gptoss_jax.server")
try:
    VERSION = importlib.metadata.version("gptoss-jax")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
    VERSION = "unknown"
GENERATION_PROMPT = [tokenizer_lib.START, 173781]  # <|start|>assistant: what a rendered chat prompt ends with
APIError = P.APIError
ENGINE_ERRORS = (EngineDeadError, RequestFailedError)
MAX_JSON_DEPTH = 64  # nesting of a request body (a tool schema nests a few levels below the top)
MAX_TOKEN_CHARS = (
    128  # the longest o200k token is 128 bytes: a message of more than 128 x context characters cannot fit
)


@dataclasses.dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    conversation_start_date: str | None = None
    model_identity: str | None = None
    default_max_tokens: int | None = None
    max_choices: int = 128  # sequences one request may start: prompts x n on /v1/completions, n elsewhere
    body_timeout_s: float = 60.0  # the whole body must arrive within this (slow senders, short bodies)
    max_stored_responses: int = 1000  # Responses API `store`: the most recently used are kept (LRU)


class ServerShuttingDownError(RequestFailedError):
    """The drain timeout passed while this request was still running."""


class State:
    def __init__(self, engine: AsyncEngine, tokenizer, cfg: ServerConfig):
        self.engine = engine
        self.tok = tokenizer
        self.cfg = cfg
        self.renderer = harmony.Renderer(cfg.conversation_start_date, cfg.model_identity, tokenizer)
        self.metrics = Metrics(cfg.model_name)
        self.ready = False
        self.draining = False
        self.created = int(time.time())
        self.responses = ResponseStore(cfg.max_stored_responses)

    def begin_drain(self) -> None:
        """Shutdown began: new requests get 503, running ones go on."""
        self.draining = True

    def cut_off(self, drain_timeout_s: float) -> None:
        """The drain timeout passed: end every running request with an error (streams get an error event and
        [DONE], the others a 503)."""
        self.engine.fail_all(
            ServerShuttingDownError(
                f"The server is shutting down; this request was still running after the {drain_timeout_s:g} s drain "
                "timeout. Retry it on another replica."
            )
        )


class ResponseStore:
    """Stored Responses API responses (`store`, `previous_response_id`, `GET /v1/responses/{id}`): in memory, at most
    `capacity` of them; past that the least recently used (stored, read or continued) is evicted."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: collections.OrderedDict[str, dict] = collections.OrderedDict()

    def put(self, resp_id: str, entry: dict) -> None:
        if self.capacity <= 0:
            return
        self._items[resp_id] = entry
        self._items.move_to_end(resp_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, resp_id: str) -> dict | None:
        entry = self._items.get(resp_id)
        if entry is not None:
            self._items.move_to_end(resp_id)
        return entry

    def delete(self, resp_id: str) -> bool:
        return self._items.pop(resp_id, None) is not None


class _ClientGone(Exception):
    """The client closed the connection before its response was complete (nothing is sent)."""


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def _error_response(e: APIError, metrics: Metrics | None = None) -> JSONResponse:
    if metrics is not None:
        metrics.http_error(e.status)
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _check_auth(st: State, request: Request) -> None:
    if not st.cfg.api_key:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), st.cfg.api_key.encode()):
        raise APIError(
            401, "Incorrect API key provided. Pass it as 'Authorization: Bearer <key>'.", code="invalid_api_key"
        )


async def _read_json(st: State, request: Request) -> dict:
    limit = st.cfg.max_body_bytes
    try:
        declared = int(request.headers.get("content-length", "0"))
    except ValueError:
        raise APIError(400, "Invalid Content-Length header.") from None
    if declared > limit:
        raise APIError(
            413, f"Request body of {declared} bytes exceeds the limit of {limit} bytes.", code="request_too_large"
        )
    chunks, size = [], 0
    try:
        async with asyncio.timeout(st.cfg.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"Request body exceeds the limit of {limit} bytes.", code="request_too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(
            408, f"The request body did not arrive within {st.cfg.body_timeout_s:g} s.", code="request_timeout"
        ) from None
    except ClientDisconnect:
        raise _ClientGone from None
    try:
        body = json.loads(b"".join(chunks), parse_constant=_no_constant)
    except RecursionError:
        raise APIError(400, f"The JSON body nests deeper than {MAX_JSON_DEPTH} levels.", code="invalid_json") from None
    except ValueError as e:  # bad JSON or UTF-8, NaN/Infinity, an integer of more than 4,300 digits
        raise APIError(
            400,
            f"We could not parse the JSON body of your request ({e}). The body must be valid JSON.",
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    _check_json(body)
    return body


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _check_json(body: dict) -> None:
    """Nesting within MAX_JSON_DEPTH, and every string valid Unicode (JSON escapes can spell lone surrogates,
    which no tokenizer encodes)."""
    stack = [(body, 1)]
    while stack:
        x, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"The JSON body nests deeper than {MAX_JSON_DEPTH} levels.", code="invalid_json")
        items = x.items() if isinstance(x, dict) else enumerate(x)
        for k, v in items:
            for s in (k, v):
                if isinstance(s, str):
                    try:
                        s.encode("utf-8")
                    except UnicodeEncodeError:
                        raise APIError(
                            400,
                            f"The JSON body holds a string that is not valid Unicode (a lone surrogate): {s[:40]!r}.",
                            code="invalid_json",
                        ) from None
            if isinstance(v, (dict, list)):
                stack.append((v, depth + 1))


def _validate(model_cls, body: dict):
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        raise P.validation_error(e) from None


def _check_model(st: State, name: str | None) -> None:
    if name is not None and name != st.cfg.model_name:
        raise APIError(
            404,
            f"The model `{name}` does not exist. This server serves `{st.cfg.model_name}`.",
            param="model",
            code="model_not_found",
        )


def _check_ready(st: State) -> None:
    if st.draining:
        raise APIError(503, "The server is shutting down.", type="server_error", code="server_shutting_down")
    if st.engine.dead is not None:
        raise APIError(500, f"The engine failed: {st.engine.dead}", type="server_error")
    if not st.ready:
        raise APIError(
            503,
            "The model is still loading; retry when GET /health returns 200.",
            type="server_error",
            code="model_not_ready",
        )


def _max_tokens(st: State, prompt_len: int, requested: int | None, what: str) -> int:
    L = st.engine.max_model_len
    if requested is None:
        if prompt_len >= L:
            raise APIError(
                400,
                f"This model's maximum context length is {L} tokens. However, your {what} "
                f"resulted in {prompt_len} tokens. Please reduce the length of the {what}.",
                param=what,
                code="context_length_exceeded",
            )
        requested = L - prompt_len
        if st.cfg.default_max_tokens:
            requested = min(requested, st.cfg.default_max_tokens)
        return requested
    if prompt_len + requested > L:
        raise APIError(
            400,
            f"This model's maximum context length is {L} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the {what}, {requested} in the "
            f"completion). Please reduce the length of the {what} or completion.",
            param=what,
            code="context_length_exceeded",
        )
    return requested


_SP_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def _sampling_params(
    *,
    temperature,
    top_p,
    top_k,
    min_p,
    seed,
    max_tokens,
    logprobs,
    vocab_size: int | None = None,
    processors=None,
    structured_outputs: structured.StructuredOutputsParams | None = None,
    thinking_token_budget: int | None = None,
) -> SamplingParams:
    """The engine's `SamplingParams` for one choice (`processors`: `_processors`' fields); a value out of bounds is a
    400 naming the parameter."""
    if vocab_size is not None and top_k is not None and top_k > vocab_size:
        raise APIError(
            400, f"'top_k' is {top_k}; at most the vocabulary size {vocab_size} (-1 or 0 disable it).", param="top_k"
        )
    kw = {
        "temperature": 1.0 if temperature is None else float(temperature),
        "top_p": 1.0 if top_p is None else float(top_p),
        "top_k": 0 if top_k in (None, -1) else int(top_k),
        "min_p": 0.0 if min_p is None else float(min_p),
        "seed": seed,
        "max_tokens": int(max_tokens),
        "stop_token_ids": harmony.STOP_TOKENS,
        "structured_outputs": structured_outputs,
        "thinking_token_budget": thinking_token_budget,
        **(processors or {}),
    }
    if logprobs is not None:
        if "logprobs" not in _SP_FIELDS:
            raise APIError(400, "logprobs are not supported by this engine.", param="logprobs")
        kw["logprobs"] = int(logprobs)
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        field = str(e).partition("=")[0].removeprefix("SamplingParams.")
        raise APIError(400, str(e), param=field if field in _SP_FIELDS else None) from None


def _choice_seed(seed: int | None, i: int) -> int | None:
    """Choice i's seed: `seed + i`, wrapped into the 64-bit range."""
    if seed is None:
        return None
    lo, hi = sampling.SEED_RANGE
    return (seed + i - lo) % (hi - lo + 1) + lo


def _stops(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > sampling.MAX_STOP_STRINGS:
        raise APIError(400, f"At most {sampling.MAX_STOP_STRINGS} stop sequences are supported.", param="stop")
    if any(len(s) > sampling.MAX_STOP_CHARS for s in stops):
        raise APIError(400, f"A stop sequence may have at most {sampling.MAX_STOP_CHARS} characters.", param="stop")
    return [s for s in stops if s]


def _check_chars(st: State, items: list, param: str) -> None:
    """A message (or prompt, or input item) whose text alone cannot fit in the context is refused before it is
    rendered: more than MAX_TOKEN_CHARS characters per token of the context. `items` are named `param[i]`, or
    `param` when `items` is not a list."""
    cap = MAX_TOKEN_CHARS * st.engine.max_model_len
    for i, item in enumerate(items if isinstance(items, list) else [items]):
        name = f"{param}[{i}]" if isinstance(items, list) else param
        n, stack = 0, [item]
        while stack:
            x = stack.pop()
            if isinstance(x, str):
                n += len(x)
            elif isinstance(x, dict):
                stack += x.values()
            elif isinstance(x, list):
                stack += x
        if n > cap:
            raise APIError(
                400,
                f"{name} has {n} characters; this model's context of {st.engine.max_model_len} tokens holds "
                f"at most {cap}.",
                param=name,
                code="context_length_exceeded",
            )


# Parameters of the OpenAI and vLLM APIs this server does not implement: each is a 400 naming it unless it has the
# value that means "off" (a request must never have a setting silently ignored).
UNSUPPORTED = {
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "early_stopping": (None, False),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,),
    "return_tokens_as_token_ids": (None, False),
    "min_p_tokens": (None,),
    "logits_processors": (None,),
    "prediction": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "web_search_options": (None,),
    "chat_template": (None,),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "documents": (None,),
}


# The same for the Responses API.
RESPONSES_UNSUPPORTED = {
    "top_logprobs": (None, 0),
    "truncation": (None, "disabled"),
    "background": (None, False),
    "include": (None, []),
    "max_tool_calls": (None,),
    "prompt": (None,),
    "conversation": (None,),
    "top_k": (None,),
    "presence_penalty": (None,),
    "frequency_penalty": (None,),
    "logit_bias": (None,),
    "seed": (None,),
    "stop": (None,),
}


def _refuse_unsupported(req, table: dict = UNSUPPORTED) -> None:
    extra = req.model_extra or {}
    for name, off in table.items():
        if name in extra and not any(extra[name] == o and type(extra[name]) is type(o) for o in off):
            raise APIError(400, f"'{name}' is not supported by this server.", param=name)


def _processors(st: State, req) -> dict:
    """The logits-processor fields of `SamplingParams` from a chat or completions request, token ids checked
    against the vocabulary (a 400 naming the id)."""
    vocab = st.tok.n_vocab

    def token_ids(name: str, ids) -> list[int]:
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"Token id {bad[0]} in '{name}' is outside the vocabulary [0, {vocab}).", param=name)
        return list(ids)

    out: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"):
        if getattr(req, name) is not None:
            out[name] = getattr(req, name)
    if req.logit_bias:
        bias = {}
        for key, value in req.logit_bias.items():
            if not key.strip().isdigit():
                raise APIError(400, f"'logit_bias' keys are token ids; got {key[:40]!r}.", param="logit_bias")
            (t,) = token_ids("logit_bias", [int(key)])
            bias[t] = value
        out["logit_bias"] = bias
    if req.ignore_eos:
        out["ignore_eos"] = True
    if req.bad_words:
        out["bad_words"] = req.bad_words
    if req.allowed_token_ids is not None:
        out["allowed_token_ids"] = token_ids("allowed_token_ids", req.allowed_token_ids)
    if req.stop_token_ids:
        out["stop_token_ids"] = harmony.STOP_TOKENS + tuple(token_ids("stop_token_ids", req.stop_token_ids))
    return out


def _legacy_functions(req) -> bool:
    """Map the legacy `functions` / `function_call` onto `tools` / `tool_choice` (in place); True when the reply
    must come back in the legacy shape (`message.function_call`, finish reason "function_call")."""
    if req.functions is None:
        if req.function_call is not None:
            raise APIError(400, "'function_call' needs 'functions'.", param="function_call")
        return False
    if req.tools is not None:
        raise APIError(400, "Give 'tools' or the legacy 'functions', not both.", param="functions")
    if not isinstance(req.functions, list) or not all(isinstance(f, dict) for f in req.functions):
        raise APIError(400, "'functions' must be a list of function objects.", param="functions")
    req.tools = [{"type": "function", "function": f} for f in req.functions]
    fc = req.function_call
    if isinstance(fc, dict):
        if not isinstance(fc.get("name"), str):
            raise APIError(400, "'function_call' must be 'none', 'auto' or {'name': ...}.", param="function_call")
        req.tool_choice = {"type": "function", "function": {"name": fc["name"]}}
    elif fc is not None:
        req.tool_choice = fc
    return True


def _best_of(st: State, req, n: int) -> int:
    """How many choices run: `best_of` (>= n; the n with the highest cumulative log-probability are returned)."""
    if req.best_of is None or req.best_of == n:
        return n
    if req.best_of < n:
        raise APIError(400, f"'best_of' ({req.best_of}) must be at least 'n' ({n}).", param="best_of")
    if req.stream:
        raise APIError(400, "'best_of' greater than 'n' cannot be streamed.", param="best_of")
    return req.best_of


def _best(runs: list, n: int) -> list:
    """The `n` runs of highest cumulative log-probability, most likely first."""
    return sorted(runs, key=lambda r: -r.cumulative_logprob)[:n]


STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _format_constraint(fmt: Any, param: str, nested: bool) -> tuple[str, dict] | None:
    """`(param, StructuredOutputsParams fields)` of a `response_format` (chat: the schema under `json_schema`) or a
    Responses `text.format` (`nested=False`: name, schema and strict beside `type`); None for plain text."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError(400, f"'{param}' must be an object such as {{'type': 'json_object'}}.", param=param)
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return param, {"json_object": True}
    if kind != "json_schema":
        raise APIError(
            400, f"{param}.type is {kind!r}; supported: 'text', 'json_object', 'json_schema'.", param=f"{param}.type"
        )
    spec, where = (fmt.get("json_schema"), f"{param}.json_schema") if nested else (fmt, param)
    if not isinstance(spec, dict):
        raise APIError(400, f"'{where}' must be an object with 'name' and 'schema'.", param=where)
    schema, strict = spec.get("schema"), spec.get("strict")
    if not isinstance(schema, dict):
        raise APIError(400, f"'{where}.schema' must be a JSON schema object.", param=f"{where}.schema")
    if strict is not None and not isinstance(strict, bool):
        raise APIError(400, f"'{where}.strict' must be a boolean.", param=f"{where}.strict")
    return f"{where}.schema", {"json": schema, "strict": bool(strict)}


async def _structured(
    st: State, req, tools: list[harmony.Tool], fmt: tuple[str, dict] | None
) -> structured.StructuredOutputsParams | None:
    """The request's structured-output constraint, compiled once here so that a bad schema, regex or grammar is a
    400 naming it: a response format (`fmt`), vLLM's `structured_outputs` or `guided_*` extras, and `tool_choice`
    "required" or a named function (the answer must then be a call with arguments valid for its schema)."""
    sources = [fmt] if fmt else []
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        unknown = sorted(set(so) - set(STRUCTURED_KEYS))
        if unknown:
            raise APIError(
                400,
                f"structured_outputs.{unknown[0]} is not supported; give one of {', '.join(STRUCTURED_KEYS)}.",
                param=f"structured_outputs.{unknown[0]}",
            )
        given = [k for k in STRUCTURED_KEYS if so.get(k) not in (None, False)]
        if len(given) != 1:
            raise APIError(
                400,
                f"structured_outputs needs exactly one of {', '.join(STRUCTURED_KEYS)}.",
                param="structured_outputs",
            )
        sources.append((f"structured_outputs.{given[0]}", {given[0]: so[given[0]]}))
    sources += [
        (name, {key: getattr(req, name)}) for name, key in GUIDED.items() if getattr(req, name, None) is not None
    ]
    if len(sources) > 1:
        raise APIError(
            400,
            f"Give one structured-output constraint; this request has {len(sources)}: "
            + ", ".join(p for p, _ in sources),
            param=sources[1][0],
        )
    choice = req.tool_choice
    forced_call = choice == "required" or isinstance(choice, dict)
    if choice == "required" and not tools:
        raise APIError(400, "tool_choice 'required' needs at least one tool in 'tools'.", param="tool_choice")
    call_tools = [(t.name, t.parameters) for t in tools] if tools and (forced_call or sources) else None
    if not sources and not forced_call:
        return None
    param, fields = sources[0] if sources else ("tools", {})
    try:
        params = structured.StructuredOutputsParams(**fields, tools=call_tools)
        await asyncio.to_thread(structured.compile_grammar, params, st.tok)
    except ValueError as e:
        raise APIError(400, f"Invalid {param}: {e}", param=param) from None
    return params


def _new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def _tok_str(tok, t: int) -> tuple[str, list[int]]:
    if t >= harmony.FIRST_SPECIAL:
        return "", []
    try:
        b = tok.decode_single_token_bytes(int(t))
    except KeyError:
        return "", []
    return b.decode("utf-8", errors="replace"), list(b)


# ------------------------------------------------------------------------------------------------
# one choice: engine outputs -> events
# ------------------------------------------------------------------------------------------------


class ChoiceRun:
    """Turns one request's `StepOutput`s into ordered events, the single source of every response.

    Events: ("reasoning", text) | ("content", text, logprob_entries) | ("tool_start", i, call_id, name)
    | ("tool_args", i, text). After the run: `finish_reason`, `num_tokens`, `num_reasoning_tokens`.
    """

    def __init__(
        self,
        st: State,
        index: int,
        *,
        mode: str,
        tool_names=(),
        stops=(),
        top_logprobs: int | None = None,
        min_tokens: int = 0,
    ):
        self.st, self.index, self.mode = st, index, mode  # mode: "harmony" | "text"
        self.parser = harmony.OutputParser(st.tok, tool_names) if mode == "harmony" else None
        self.detok = harmony.TextDetokenizer(st.tok) if mode == "text" else None
        self.stops = harmony.StopStrings(list(stops))
        self.top_logprobs = top_logprobs
        self.call_ids: list[str] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_tokens = 0
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self._held: dict[int, dict | None] = {}  # logprob entries of the tokens of a header not yet parsed
        self.min_tokens = min_tokens  # stop strings apply from this many tokens on (vLLM)
        self._logprobs: list[float] = []  # of every token (when the engine sends them): `cumulative_logprob`

    @property
    def cumulative_logprob(self) -> float:
        return sum(self._logprobs[: self.num_tokens])

    @property
    def num_reasoning_tokens(self) -> int:
        return self.parser.num_reasoning_tokens if self.parser else 0

    def _lp_entry(self, t: int, lp) -> dict | None:
        if lp is None or self.top_logprobs is None:
            return None
        logprob, tops = lp
        s, b = _tok_str(self.st.tok, t)
        entry = {"token": s, "logprob": float(logprob), "bytes": b, "top_logprobs": []}
        for tid, tlp in list(tops)[: self.top_logprobs]:
            ts, tb = _tok_str(self.st.tok, int(tid))
            entry["top_logprobs"].append({"token": ts, "logprob": float(tlp), "bytes": tb})
        return entry

    def _content(self, events: list, text: str, lp: dict | None = None, token: int | None = None) -> None:
        """Content `text` (of token index `token`, the last one fed by default) and its logprob entry."""
        early = (self.num_tokens if token is None else token + 1) < self.min_tokens
        text = self.stops.push(text, match=not early)
        if events and events[-1][0] == "content":
            _, prev, lps = events[-1]
            events[-1] = ("content", prev + text, lps + ([lp] if lp else []))
        elif text or lp:
            events.append(("content", text, [lp] if lp else []))

    def _apply(self, events: list, deltas: list[harmony.Delta]) -> None:
        for d in deltas:
            if self.stops.hit:
                return
            if d.kind == "content" and d.token is not None:  # held back in a header: its own logprob
                self._content(events, d.text, self._held.pop(d.token, None), d.token)
                if self.stops.hit:
                    self.num_tokens = d.token + 1  # the stop string ended at that token
            elif d.kind == "content":
                self._content(events, d.text)
            elif d.kind == "reasoning":
                if events and events[-1][0] == "reasoning":
                    events[-1] = ("reasoning", events[-1][1] + d.text)
                else:
                    events.append(("reasoning", d.text))
            elif d.kind == "tool_start":
                self.call_ids.append(_new_id("call_"))
                events.append(("tool_start", d.tool_index, self.call_ids[-1], d.name))
            elif d.kind == "tool_args":
                if events and events[-1][0] == "tool_args" and events[-1][1] == d.tool_index:
                    events[-1] = ("tool_args", d.tool_index, events[-1][2] + d.text)
                else:
                    events.append(("tool_args", d.tool_index, d.text))

    def feed(self, out) -> list:
        """Events for one StepOutput; sets `finish_reason` when the choice is done."""
        events: list = []
        self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = getattr(out, "num_cached_prompt_tokens", 0) or self.num_cached_tokens
        lps = getattr(out, "logprobs", None) or [None] * len(out.new_token_ids)
        for t, lp in zip(out.new_token_ids, lps):
            if self.stops.hit:
                break
            self.num_tokens += 1
            if lp is not None:
                self._logprobs.append(float(lp[0]))
            entry = self._lp_entry(t, lp)
            if self.mode == "text":
                text = self.detok.process(t)
                if t >= harmony.FIRST_SPECIAL:
                    entry = None
                self._content(events, text, entry)
            else:
                i = self.parser.num_tokens
                self._held[i] = entry if t < harmony.FIRST_SPECIAL else None
                self._apply(events, self.parser.process(t))
                entry = self._held.pop(i, None) if self.parser.last_token_kind != "header" else None
                if entry is not None and self.parser.last_token_kind == "content":
                    self._content(events, "", entry)
                first_held = self.parser.num_tokens - len(self.parser.header)
                self._held = {j: e for j, e in self._held.items() if j >= first_held}
        if not self.stops.hit and out.finished:
            tail = self.detok.finish() if self.mode == "text" else None
            if tail is not None:
                self._content(events, tail)
            else:
                self._apply(events, self.parser.finish())
        if self.stops.hit:
            self.finish_reason, self.stop_reason = "stop", "stop_string"
        elif out.finished:
            self._content(events, self.stops.flush())
            reason = out.finish_reason
            self.stop_reason = out.stop_reason
            if reason == "stop" and self.call_ids:
                reason = "tool_calls"
            self.finish_reason = reason
        return events


async def _run_choice(run: ChoiceRun, stream, metrics: Metrics, t0: float) -> AsyncIterator[tuple]:
    """Yield `(index, events, finish_reason|None)` until the choice finishes; abort on early exit. The request
    counters are kept by `_account` once the response is delivered (or not)."""
    last, first = t0, True
    try:
        async for out in stream:
            now = time.perf_counter()
            if out.new_token_ids:
                metrics.observe_tokens(first, now - last, len(out.new_token_ids))
                first, last = False, now
            events = run.feed(out)
            if run.finish_reason is not None:
                metrics.e2e.observe(time.perf_counter() - t0)
                yield run.index, events, run.finish_reason
                return
            if events:
                yield run.index, events, None
    finally:
        stream.close()  # aborts unless the engine finished it (a stop string did not)


def _account(st: State, runs: list[ChoiceRun], outcome: str) -> None:
    """Count a request's choices once its response is over: "delivered" (by finish reason), "gone" (the client
    left first: aborted, whatever the engine had finished) or "failed" (an engine error or the shutdown)."""
    for r in runs:
        if outcome == "delivered" and r.finish_reason in ("stop", "length", "tool_calls"):
            st.metrics.request_finished(r.finish_reason)
        elif outcome == "gone":
            st.metrics.request_aborted()


def _engine_error(st: State, e: BaseException) -> APIError:
    """The API error for an engine failure (counted once in http_request_errors_total)."""
    if isinstance(e, ServerShuttingDownError):
        err = APIError(503, str(e), type="server_error", code="server_shutting_down")
    else:
        err = APIError(500, str(e), type="server_error", code="engine_error")
    st.metrics.http_error(err.status)
    return err


def _sse_error(st: State, e: BaseException) -> str:
    """A stream's last words after an engine failure: an error event, then [DONE]."""
    return "data: " + json.dumps(_engine_error(st, e).body()) + "\n\ndata: [DONE]\n\n"


async def _merge(gens: list[AsyncIterator]) -> AsyncIterator[tuple]:
    """Interleave several choices' event streams as they arrive; closing aborts them all."""
    if len(gens) == 1:
        async for item in gens[0]:
            yield item
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(g):
        try:
            async for item in g:
                await q.put(item)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - re-raised by the consumer
            await q.put(e)
        finally:
            await q.put(done)

    tasks = [asyncio.create_task(pump(g)) for g in gens]
    try:
        left = len(tasks)
        while left:
            item = await q.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _start_choices(
    st: State, request: Request, rid: str, prompts: list[list[int]], params: list[SamplingParams]
) -> list:
    """Add every choice's request to the engine in one command (all or none), unless the client leaves first."""
    add = asyncio.ensure_future(
        st.engine.add_many([(f"{rid}-{i}", ids, p) for i, (ids, p) in enumerate(zip(prompts, params))])
    )
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({add, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not add.done():
            add.cancel()  # aborts whatever the engine accepted
            await asyncio.gather(add, return_exceptions=True)
    if add.cancelled():
        raise _ClientGone
    try:
        return add.result()
    except ValueError as e:  # the engine's checks name the field as "SamplingParams.FIELD..."
        field = str(e).removeprefix("SamplingParams.").partition("=")[0].partition(":")[0]
        raise APIError(400, str(e), param=field if field in _SP_FIELDS else None) from None
    except ENGINE_ERRORS as e:
        raise _engine_error(st, e) from None


async def _until_disconnect(request: Request) -> None:
    """Completes when the client goes away (the body has been read already)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _collect(st: State, request: Request, runs: list[ChoiceRun], events: AsyncIterator, sink) -> None:
    """Feed all events to `sink`. Raises `_ClientGone` when the client disconnects first (the choices are
    aborted), the engine failure as an `APIError`; a cancellation (the server stopping) propagates."""

    async def consume():
        async for item in events:
            sink(item)

    task = asyncio.create_task(consume())
    watch = asyncio.create_task(_until_disconnect(request))
    st.metrics.in_flight += 1
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        st.metrics.in_flight -= 1
        watch.cancel()
        gone = not task.done()
        if gone:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await events.aclose()
    if gone:
        _account(st, runs, "gone")
        raise _ClientGone
    try:
        task.result()
    except ENGINE_ERRORS as e:
        _account(st, runs, "failed")
        raise _engine_error(st, e) from None
    _account(st, runs, "delivered")


def _usage(runs: list[ChoiceRun], prompt_tokens: int) -> dict:
    completion = sum(r.num_tokens for r in runs)
    cached = max((r.num_cached_tokens for r in runs), default=0)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": sum(r.num_reasoning_tokens for r in runs)},
    }


# ------------------------------------------------------------------------------------------------
# chat completions
# ------------------------------------------------------------------------------------------------


async def chat_completions(request: Request) -> Response:
    st: State = request.app.state.st
    _check_auth(st, request)
    body = await _read_json(st, request)
    req = _validate(P.ChatCompletionRequest, body)
    _check_model(st, req.model)
    _refuse_unsupported(req)
    legacy = _legacy_functions(req)
    fmt = _format_constraint(req.response_format, "response_format", nested=True)
    _check_ready(st)
    effort = harmony.parse_reasoning_effort(
        ("reasoning_effort", req.reasoning_effort),
        ("reasoning.effort", (req.reasoning or {}).get("effort")),
        ("chat_template_kwargs.reasoning_effort", (req.chat_template_kwargs or {}).get("reasoning_effort")),
    )
    tools = harmony.parse_chat_tools(req.tools, req.tool_choice)
    constraint = await _structured(st, req, tools, fmt)
    _check_chars(st, req.messages, "messages")
    prompt = await asyncio.to_thread(st.renderer.render_chat, req.messages, tools, effort)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = _max_tokens(st, len(prompt), requested, "messages")
    top = (req.top_logprobs or 0) if req.logprobs else None
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
    stops = _stops(req.stop)
    k = _best_of(st, req, req.n)
    processors = _processors(st, req)
    params = [
        _sampling_params(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            seed=_choice_seed(req.seed, i),
            max_tokens=max_tokens,
            logprobs=top if k == req.n or top is not None else 0,
            vocab_size=st.tok.n_vocab,
            processors=processors,
            structured_outputs=constraint,
            thinking_token_budget=req.thinking_token_budget,
        )
        for i in range(k)
    ]
    rid = _new_id("chatcmpl-")
    created = int(time.time())
    runs = [
        ChoiceRun(
            st,
            i,
            mode="harmony",
            tool_names=[t.name for t in tools],
            stops=stops,
            top_logprobs=top,
            min_tokens=req.min_tokens or 0,
        )
        for i in range(k)
    ]
    t0 = time.perf_counter()
    streams = await _start_choices(st, request, rid, [prompt] * k, params)
    events = _merge([_run_choice(r, s, st.metrics, t0) for r, s in zip(runs, streams)])
    include_reasoning = req.include_reasoning
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": st.cfg.model_name}

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(index, delta, finish=None, logprobs=None):
            c = dict(base, choices=[{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}])
            if include_usage:
                c["usage"] = None
            return "data: " + json.dumps(c, ensure_ascii=False, separators=(",", ":")) + "\n\n"

        async def gen():
            st.metrics.in_flight += 1
            outcome = "gone"
            try:
                for r in runs:
                    yield chunk(r.index, {"role": "assistant", "content": ""})
                async for index, evs, finish in events:
                    for ev in evs:
                        delta, lps = _chat_delta(ev, include_reasoning, legacy)
                        if delta is not None:
                            yield chunk(index, delta, logprobs=lps)
                    if finish is not None:
                        yield chunk(index, {}, "function_call" if legacy and finish == "tool_calls" else finish)
                if include_usage:
                    yield "data: " + json.dumps(dict(base, choices=[], usage=_usage(runs, len(prompt)))) + "\n\n"
                outcome = "delivered"
                yield "data: [DONE]\n\n"
            except ENGINE_ERRORS as e:
                outcome = "failed"
                yield _sse_error(st, e)
            finally:
                st.metrics.in_flight -= 1
                _account(st, runs, outcome)
                await events.aclose()

        return SSEResponse(gen())

    choices = {r.index: {"content": [], "reasoning": [], "tools": {}, "logprobs": []} for r in runs}

    def sink(item):
        index, evs, _ = item
        acc = choices[index]
        for ev in evs:
            if ev[0] == "content":
                acc["content"].append(ev[1])
                acc["logprobs"] += ev[2]
            elif ev[0] == "reasoning":
                acc["reasoning"].append(ev[1])
            elif ev[0] == "tool_start":
                acc["tools"][ev[1]] = {"id": ev[2], "type": "function", "function": {"name": ev[3], "arguments": ""}}
            elif ev[0] == "tool_args":
                acc["tools"][ev[1]]["function"]["arguments"] += ev[2]

    await _collect(st, request, runs, events, sink)
    out_choices = []
    for j, r in enumerate(_best(runs, req.n) if k != req.n else runs):
        acc = choices[r.index]
        content = "".join(acc["content"])
        tool_calls = [acc["tools"][t] for t in sorted(acc["tools"])]
        msg: dict[str, Any] = {"role": "assistant", "content": content if (content or not tool_calls) else None}
        reasoning = "".join(acc["reasoning"])
        if include_reasoning:
            msg["reasoning_content"] = reasoning or None
            msg["reasoning"] = reasoning or None
        finish = r.finish_reason
        if tool_calls and legacy:  # one call, as `function_call`
            msg["function_call"] = tool_calls[0]["function"]
            finish = "function_call" if finish == "tool_calls" else finish
        elif tool_calls:
            msg["tool_calls"] = tool_calls
        out_choices.append(
            {
                "index": j,
                "message": msg,
                "logprobs": {"content": acc["logprobs"]} if top is not None else None,
                "finish_reason": finish,
            }
        )
    return JSONResponse(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": st.cfg.model_name,
            "choices": out_choices,
            "usage": _usage(runs, len(prompt)),
        }
    )


def _chat_delta(ev, include_reasoning: bool, legacy: bool = False) -> tuple[dict | None, dict | None]:
    """A chat event's delta and logprobs; with `legacy` (`functions` in the request) the first tool call as
    `function_call` (later ones are dropped, as the legacy API has one call)."""
    kind = ev[0]
    if legacy and kind in ("tool_start", "tool_args"):
        if ev[1] != 0:
            return None, None
        return {
            "function_call": {"name": ev[3], "arguments": ""} if kind == "tool_start" else {"arguments": ev[2]}
        }, None
    if kind == "content":
        return {"content": ev[1]}, ({"content": ev[2]} if ev[2] else None)
    if kind == "reasoning":
        return ({"reasoning_content": ev[1], "reasoning": ev[1]} if include_reasoning else None), None
    if kind == "tool_start":
        return {
            "tool_calls": [
                {"index": ev[1], "id": ev[2], "type": "function", "function": {"name": ev[3], "arguments": ""}}
            ]
        }, None
    if kind == "tool_args":
        return {"tool_calls": [{"index": ev[1], "function": {"arguments": ev[2]}}]}, None
    return None, None


# ------------------------------------------------------------------------------------------------
# completions (raw prompt, no template)
# ------------------------------------------------------------------------------------------------


def _completion_prompts(st: State, prompt, n: int) -> list[list[int]]:
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    if not prompts:
        raise APIError(400, "'prompt' must not be empty.", param="prompt")
    if len(prompts) * n > st.cfg.max_choices:
        raise APIError(
            400,
            f"{len(prompts)} prompts x n={n} would start {len(prompts) * n} sequences; at most "
            f"{st.cfg.max_choices} per request.",
            param="prompt",
        )
    _check_chars(st, prompts, "prompt")
    out = []
    vocab = st.tok.n_vocab
    for p in prompts:
        ids = st.tok.encode(p, allowed_special="all") if isinstance(p, str) else list(p)
        if not ids:
            raise APIError(400, "'prompt' must not be empty.", param="prompt")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(
                400, f"Token id {bad[0]} in 'prompt' is outside the vocabulary [0, {vocab}).", param="prompt"
            )
        out.append(ids)
    return out


async def completions(request: Request) -> Response:
    st: State = request.app.state.st
    _check_auth(st, request)
    body = await _read_json(st, request)
    req = _validate(P.CompletionRequest, body)
    _check_model(st, req.model)
    _refuse_unsupported(req)
    for name in ("echo", "suffix"):
        if getattr(req, name):
            raise APIError(400, f"'{name}' is not supported by this server.", param=name)
    for name in ("response_format", "structured_outputs", *GUIDED):
        if (req.model_extra or {}).get(name) is not None:
            raise APIError(
                400, f"'{name}' is served on /v1/chat/completions and /v1/responses (the harmony answer).", param=name
            )
    k = _best_of(st, req, req.n)
    _check_ready(st)
    prompts = await asyncio.to_thread(_completion_prompts, st, req.prompt, k)
    max_toks = [_max_tokens(st, len(p), req.max_tokens, "prompt") for p in prompts]
    top = req.logprobs
    stops = _stops(req.stop)
    processors = _processors(st, req)
    all_prompts, params, runs = [], [], []
    for pi, p in enumerate(prompts):
        for j in range(k):
            i = pi * k + j
            all_prompts.append(p)
            params.append(
                _sampling_params(
                    temperature=req.temperature,
                    top_p=req.top_p,
                    top_k=req.top_k,
                    min_p=req.min_p,
                    seed=_choice_seed(req.seed, i),
                    max_tokens=max_toks[pi],
                    logprobs=top if k == req.n or top is not None else 0,
                    vocab_size=st.tok.n_vocab,
                    processors=processors,
                )
            )
            runs.append(ChoiceRun(st, i, mode="text", stops=stops, top_logprobs=top, min_tokens=req.min_tokens or 0))
    rid = _new_id("cmpl-")
    created = int(time.time())
    t0 = time.perf_counter()
    streams = await _start_choices(st, request, rid, all_prompts, params)
    events = _merge([_run_choice(r, s, st.metrics, t0) for r, s in zip(runs, streams)])
    prompt_tokens = sum(len(p) for p in prompts) * req.n
    base = {"id": rid, "object": "text_completion", "created": created, "model": st.cfg.model_name}
    offsets = [0] * len(runs)

    def legacy_lps(index: int, entries: list[dict]) -> dict | None:
        if top is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            out["tokens"].append(e["token"])
            out["token_logprobs"].append(e["logprob"])
            out["top_logprobs"].append({x["token"]: x["logprob"] for x in e["top_logprobs"]})
            out["text_offset"].append(offsets[index])
            offsets[index] += len(e["token"])
        return out

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(index, text, finish=None, lps=None):
            c = dict(base, choices=[{"index": index, "text": text, "logprobs": lps, "finish_reason": finish}])
            if include_usage:
                c["usage"] = None
            return "data: " + json.dumps(c, ensure_ascii=False, separators=(",", ":")) + "\n\n"

        async def gen():
            st.metrics.in_flight += 1
            outcome = "gone"
            try:
                async for index, evs, finish in events:
                    for ev in evs:
                        yield chunk(index, ev[1], lps=legacy_lps(index, ev[2]))
                    if finish is not None:
                        yield chunk(index, "", finish)
                if include_usage:
                    u = _usage(runs, prompt_tokens)
                    yield "data: " + json.dumps(dict(base, choices=[], usage=u)) + "\n\n"
                outcome = "delivered"
                yield "data: [DONE]\n\n"
            except ENGINE_ERRORS as e:
                outcome = "failed"
                yield _sse_error(st, e)
            finally:
                st.metrics.in_flight -= 1
                _account(st, runs, outcome)
                await events.aclose()

        return SSEResponse(gen())

    texts = {r.index: [] for r in runs}
    entries = {r.index: [] for r in runs}

    def sink(item):
        index, evs, _ = item
        for ev in evs:
            texts[index].append(ev[1])
            entries[index] += ev[2]

    await _collect(st, request, runs, events, sink)
    picked = [(r.index, r) for r in runs]
    if k != req.n:  # best_of: each prompt's n most likely, numbered as n choices per prompt
        picked = [(r.index, r) for pi in range(len(prompts)) for r in _best(runs[pi * k : (pi + 1) * k], req.n)]
        for j, (_, r) in enumerate(picked):
            r.index = j
    choices = [
        {
            "index": r.index,
            "text": "".join(texts[i]),
            "logprobs": legacy_lps(i, entries[i]),
            "finish_reason": r.finish_reason,
        }
        for i, r in picked
    ]
    return JSONResponse(dict(base, choices=choices, usage=_usage(runs, prompt_tokens)))


# ------------------------------------------------------------------------------------------------
# responses (harmony-native)
# ------------------------------------------------------------------------------------------------


class _ResponseBuilder:
    """Responses output items built from chat events; emits the streaming events as it goes."""

    def __init__(self, resp_id: str):
        self.resp_id = resp_id
        self.items: list[dict] = []
        self.open: dict | None = None  # the item being written
        self.tool_items: dict[int, dict] = {}
        self.seq = 0

    def _ev(self, kind: str, **data) -> dict:
        e = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return e

    def _close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        idx = self.items.index(item)
        item["status"] = "completed"
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out += [
                self._ev(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                ),
                self._ev(
                    "response.content_part.done", item_id=item["id"], output_index=idx, content_index=0, part=part
                ),
            ]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out += [
                self._ev(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    text=part["text"],
                ),
                self._ev(
                    "response.content_part.done", item_id=item["id"], output_index=idx, content_index=0, part=part
                ),
            ]
        else:
            out.append(
                self._ev(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=idx,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        out.append(self._ev("response.output_item.done", output_index=idx, item=item))
        return out

    def _open(self, item: dict) -> list[dict]:
        out = self._close()
        self.items.append(item)
        self.open = item
        idx = len(self.items) - 1
        snapshot = json.loads(json.dumps(item))
        out.append(self._ev("response.output_item.added", output_index=idx, item=snapshot))
        if item["type"] in ("message", "reasoning"):
            out.append(
                self._ev(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    part=dict(item["content"][0]),
                )
            )
        return out

    def add(self, ev) -> list[dict]:
        kind = ev[0]
        out: list[dict] = []
        if kind == "reasoning":
            if not self.open or self.open["type"] != "reasoning":
                out += self._open(
                    {
                        "type": "reasoning",
                        "id": _new_id("rs_"),
                        "summary": [],
                        "status": "in_progress",
                        "content": [{"type": "reasoning_text", "text": ""}],
                    }
                )
            item = self.open
            item["content"][0]["text"] += ev[1]
            out.append(
                self._ev(
                    "response.reasoning_text.delta",
                    item_id=item["id"],
                    output_index=len(self.items) - 1,
                    content_index=0,
                    delta=ev[1],
                )
            )
        elif kind == "content":
            if not ev[1]:
                return out
            if not self.open or self.open["type"] != "message":
                out += self._open(
                    {
                        "type": "message",
                        "id": _new_id("msg_"),
                        "role": "assistant",
                        "status": "in_progress",
                        "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}],
                    }
                )
            item = self.open
            item["content"][0]["text"] += ev[1]
            out.append(
                self._ev(
                    "response.output_text.delta",
                    item_id=item["id"],
                    output_index=len(self.items) - 1,
                    content_index=0,
                    delta=ev[1],
                    logprobs=[],
                )
            )
        elif kind == "tool_start":
            item = {
                "type": "function_call",
                "id": _new_id("fc_"),
                "call_id": ev[2],
                "name": ev[3],
                "arguments": "",
                "status": "in_progress",
            }
            out += self._open(item)
            self.tool_items[ev[1]] = item
        elif kind == "tool_args":
            item = self.tool_items[ev[1]]
            item["arguments"] += ev[2]
            out.append(
                self._ev(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self.items.index(item),
                    delta=ev[2],
                )
            )
        return out

    def finish(self) -> list[dict]:
        return self._close()


async def responses(request: Request) -> Response:
    st: State = request.app.state.st
    _check_auth(st, request)
    body = await _read_json(st, request)
    req = _validate(P.ResponsesRequest, body)
    _check_model(st, req.model)
    _refuse_unsupported(req, RESPONSES_UNSUPPORTED)
    items = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    if req.previous_response_id is not None:  # the earlier turns: their input and output, then this input
        prev = st.responses.get(req.previous_response_id)
        if prev is None:
            raise APIError(
                400,
                f"Previous response with id '{req.previous_response_id}' not found (never stored, deleted, or evicted "
                f"from the server's {st.cfg.max_stored_responses} most recently used responses).",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        items = prev["input"] + prev["response"]["output"] + items
    text_format = (req.text or {}).get("format") if isinstance(req.text, dict) else None
    fmt = _format_constraint(text_format, "text.format", nested=False)
    _check_ready(st)
    effort = harmony.parse_reasoning_effort(("reasoning.effort", req.reasoning.effort if req.reasoning else None))
    tools = harmony.parse_chat_tools(req.tools, req.tool_choice)
    constraint = await _structured(st, req, tools, fmt)
    _check_chars(st, req.input, "input")
    _check_chars(st, req.instructions, "instructions")
    prompt = await asyncio.to_thread(st.renderer.render_responses, items, req.instructions, tools, effort)
    store = req.store is not False
    max_tokens = _max_tokens(st, len(prompt), req.max_output_tokens, "input")
    params = _sampling_params(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=None,
        min_p=None,
        seed=None,
        max_tokens=max_tokens,
        logprobs=None,
        structured_outputs=constraint,
        thinking_token_budget=req.thinking_token_budget,
    )
    resp_id = _new_id("resp_")
    created = int(time.time())
    run = ChoiceRun(st, 0, mode="harmony", tool_names=[t.name for t in tools])
    t0 = time.perf_counter()
    streams = await _start_choices(st, request, resp_id, [prompt], [params])
    events = _merge([_run_choice(run, streams[0], st.metrics, t0)])
    builder = _ResponseBuilder(resp_id)

    def response_obj(status: str) -> dict:
        r = {
            "id": resp_id,
            "object": "response",
            "created_at": created,
            "model": st.cfg.model_name,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "output": builder.items if status != "in_progress" else [],
            "parallel_tool_calls": bool(req.parallel_tool_calls),
            "reasoning": {"effort": effort, "summary": None},
            "previous_response_id": req.previous_response_id,
            "store": store,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": text_format or {"type": "text"}},
            "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [],
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "usage": None,
        }
        if status != "in_progress":
            u = _usage([run], len(prompt))
            r["usage"] = {
                "input_tokens": u["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": u["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": u["completion_tokens_details"]["reasoning_tokens"]},
                "total_tokens": u["total_tokens"],
            }
            if run.finish_reason == "length":
                r["status"] = "incomplete"
                r["incomplete_details"] = {"reason": "max_output_tokens"}
        return r

    if req.stream:

        def sse(e: dict) -> str:
            return f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False, separators=(',', ':'))}\n\n"

        async def gen():
            st.metrics.in_flight += 1
            outcome = "gone"
            try:
                yield sse(builder._ev("response.created", response=response_obj("in_progress")))
                yield sse(builder._ev("response.in_progress", response=response_obj("in_progress")))
                async for _, evs, _ in events:
                    for ev in evs:
                        for e in builder.add(ev):
                            yield sse(e)
                for e in builder.finish():
                    yield sse(e)
                final = response_obj("completed")
                if store:
                    st.responses.put(resp_id, {"response": final, "input": items})
                kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
                outcome = "delivered"
                yield sse(builder._ev(kind, response=final))
            except ENGINE_ERRORS as e:
                outcome = "failed"
                err = _engine_error(st, e)
                yield sse(builder._ev("error", message=err.message, code=err.code, param=None))
            finally:
                st.metrics.in_flight -= 1
                _account(st, [run], outcome)
                await events.aclose()

        return SSEResponse(gen())

    def sink(item):
        for ev in item[1]:
            builder.add(ev)

    await _collect(st, request, [run], events, sink)
    builder.finish()
    final = response_obj("completed")
    if store:
        st.responses.put(resp_id, {"response": final, "input": items})
    return JSONResponse(final)


async def stored_response(request: Request) -> Response:
    """GET (the stored response) and DELETE of /v1/responses/{id}."""
    st: State = request.app.state.st
    _check_auth(st, request)
    resp_id = request.path_params["resp_id"]
    entry = st.responses.get(resp_id) if request.method == "GET" else None
    if request.method == "DELETE" and st.responses.delete(resp_id):
        return JSONResponse({"id": resp_id, "object": "response", "deleted": True})
    if entry is None:
        raise APIError(404, f"No response found with id '{resp_id}'.", param="response_id", code="not_found")
    return JSONResponse(entry["response"])


# ------------------------------------------------------------------------------------------------
# models, health, metrics
# ------------------------------------------------------------------------------------------------


def _model_card(st: State) -> dict:
    return {
        "id": st.cfg.model_name,
        "object": "model",
        "created": st.created,
        "owned_by": "gptoss-jax",
        "max_model_len": st.engine.max_model_len or None,
    }


async def models(request: Request) -> Response:
    st: State = request.app.state.st
    _check_auth(st, request)
    return JSONResponse({"object": "list", "data": [_model_card(st)]})


async def model(request: Request) -> Response:
    st: State = request.app.state.st
    _check_auth(st, request)
    _check_model(st, request.path_params["model_id"])
    return JSONResponse(_model_card(st))


async def tokenize(request: Request) -> Response:
    """vLLM's /tokenize: a `prompt` (as /v1/completions encodes it) or chat `messages` (rendered as
    /v1/chat/completions renders them, with `tools` and `reasoning_effort`; `add_generation_prompt: false` leaves out
    the closing `<|start|>assistant`). o200k has no BOS/EOS to add, so `add_special_tokens` changes nothing."""
    st: State = request.app.state.st
    _check_auth(st, request)
    req = _validate(P.TokenizeRequest, await _read_json(st, request))
    _check_model(st, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "Give exactly one of 'prompt' or 'messages'.", param="prompt")
    if req.prompt is not None:
        _check_chars(st, req.prompt, "prompt")
        ids = await asyncio.to_thread(st.tok.encode, req.prompt, allowed_special="all")
    else:
        effort = harmony.parse_reasoning_effort(("reasoning_effort", req.reasoning_effort))
        tools = harmony.parse_chat_tools(req.tools, req.tool_choice)
        _check_chars(st, req.messages, "messages")
        ids = await asyncio.to_thread(st.renderer.render_chat, req.messages, tools, effort)
        if not req.add_generation_prompt:
            ids = ids[: -len(GENERATION_PROMPT)] if ids[-len(GENERATION_PROMPT) :] == GENERATION_PROMPT else ids
    strs = [_token_text(st.tok, t) for t in ids] if req.return_token_strs else None
    return JSONResponse(
        {"count": len(ids), "max_model_len": st.engine.max_model_len, "tokens": ids, "token_strs": strs}
    )


async def detokenize(request: Request) -> Response:
    """vLLM's /detokenize: `tokens` -> `prompt`, the text (special tokens written out)."""
    st: State = request.app.state.st
    _check_auth(st, request)
    req = _validate(P.DetokenizeRequest, await _read_json(st, request))
    _check_model(st, req.model)
    bad = [t for t in req.tokens if not 0 <= t < st.tok.n_vocab]
    if bad:
        raise APIError(
            400, f"Token id {bad[0]} in 'tokens' is outside the vocabulary [0, {st.tok.n_vocab}).", param="tokens"
        )
    return JSONResponse({"prompt": "".join(_token_text(st.tok, t) for t in req.tokens)})


def _token_text(tok, t: int) -> str:
    try:
        return tok.decode_single_token_bytes(t).decode("utf-8", errors="replace")
    except KeyError:  # an id o200k leaves unassigned
        return ""


async def version(request: Request) -> Response:
    return JSONResponse({"version": VERSION})


async def health(request: Request) -> Response:
    st: State = request.app.state.st
    if st.engine.dead is not None:
        return JSONResponse({"status": "error", "error": str(st.engine.dead)}, status_code=500)
    if not st.ready:
        return JSONResponse({"status": "loading", **st.engine.status}, status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    st: State = request.app.state.st
    text = st.metrics.render(stats_dict(st.engine.stats_snapshot))
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


def _wrap(handler):
    async def endpoint(request: Request) -> Response:
        st: State = request.app.state.st
        try:
            return await handler(request)
        except APIError as e:
            return _error_response(e, st.metrics)
        except harmony.RenderError as e:
            return _error_response(APIError(400, str(e), param=e.param), st.metrics)
        except _ClientGone:
            return Response(status_code=499)  # nobody is listening; counted as aborted where choices had started

    return endpoint


async def _http_exception(request: Request, exc: HTTPException) -> Response:
    msg = {
        404: f"Unknown path {request.url.path}.",
        405: f"Method {request.method} is not allowed on {request.url.path}.",
    }.get(exc.status_code, exc.detail)
    return _error_response(APIError(exc.status_code, msg), request.app.state.st.metrics)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path, exc_info=exc)
    err = APIError(500, f"Internal server error: {type(exc).__name__}", type="server_error")
    return _error_response(err, request.app.state.st.metrics)


def build_app(st: State, lifespan=None) -> Starlette:
    routes = [
        Route("/v1/chat/completions", _wrap(chat_completions), methods=["POST"]),
        Route("/v1/completions", _wrap(completions), methods=["POST"]),
        Route("/v1/responses", _wrap(responses), methods=["POST"]),
        Route("/v1/models", _wrap(models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", _wrap(model), methods=["GET"]),
        Route("/v1/responses/{resp_id}", _wrap(stored_response), methods=["GET", "DELETE"]),
        Route("/tokenize", _wrap(tokenize), methods=["POST"]),
        Route("/detokenize", _wrap(detokenize), methods=["POST"]),
        Route("/version", version, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_exception, Exception: _server_error}
    )
    app.router.redirect_slashes = False  # '/v1/models/' is a 404, not a redirect built from the Host header
    app.state.st = st
    return app
