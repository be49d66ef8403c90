"""Harmony for the server: render OpenAI-style requests to prompt token ids, parse generated ids back.

Rendering goes through `openai-harmony` (system message with reasoning effort and channels, developer
message with instructions and the `functions` namespace, history with tool calls and tool results).

Parsing is our own tolerant state machine over token ids, one `OutputParser` per request and choice.
It turns generated ids into ordered deltas: `reasoning` (the `analysis` channel), `content` (`final`,
`commentary` preambles, headerless text) and tool calls (a `functions.*` recipient). Control tokens
never reach any text; malformed output (a missing header, a stray `<|start|>`, text between
messages) degrades to content instead of raising.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable

from gptoss_jax import tokenizer as tokenizer_lib
from gptoss_jax.tokenizer import CALL, CHANNEL, CONSTRAIN, END, ENDOFTEXT, MESSAGE, RETURN, START

FIRST_SPECIAL = 199998  # o200k_harmony: every id >= this is a special token
STOP_TOKENS = (RETURN, CALL, ENDOFTEXT)  # sampling stops: <|return|>, <|call|>, <|endoftext|> (safety net)
REASONING_EFFORTS = ("low", "medium", "high")
DEFAULT_REASONING_EFFORT = "medium"
MAX_HEADER_TOKENS = 48  # a header longer than this is treated as headerless text


class RenderError(ValueError):
    """The request cannot be rendered (bad message shape); the server answers 400 with `param`."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


_ENCODING = None


def load_encoding(rank_file: str | os.PathLike | None = None):
    """The harmony encoding, loaded once, from `rank_file` (default: `tokenizer.rank_file()`'s lookup, which
    downloads when nothing local is found). openai-harmony reads the vocabulary only from
    `$TIKTOKEN_ENCODINGS_BASE/o200k_base.tiktoken`, so that variable points at the file's folder while it loads."""
    global _ENCODING
    if _ENCODING is None:
        import openai_harmony as oh

        path = Path(rank_file) if rank_file is not None else tokenizer_lib.rank_file()
        if path.name != tokenizer_lib.RANK_FILE:  # openai-harmony wants this exact name: a link of that name
            link = tokenizer_lib.downloaded_copy().parent / "linked" / tokenizer_lib.RANK_FILE
            link.parent.mkdir(parents=True, exist_ok=True)
            link.unlink(missing_ok=True)
            link.symlink_to(path.resolve())
            path = link
        before = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
        os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(path.parent)
        try:
            _ENCODING = oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
        finally:
            if before is None:
                os.environ.pop("TIKTOKEN_ENCODINGS_BASE")
            else:
                os.environ["TIKTOKEN_ENCODINGS_BASE"] = before
    return _ENCODING


def parse_reasoning_effort(*candidates: tuple[str, Any]) -> str:
    """First non-None effort among `(param_name, value)` pairs, validated; default `medium`."""
    for param, value in candidates:
        if value is None:
            continue
        if not isinstance(value, str) or value.lower() not in REASONING_EFFORTS:
            raise RenderError(
                f"Invalid value for '{param}': {value!r}. Supported values are 'low', 'medium' and 'high'.", param
            )
        return value.lower()
    return DEFAULT_REASONING_EFFORT


# ---------------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Tool:
    name: str
    description: str = ""
    parameters: dict | None = None


def _text_of(content: Any, param: str) -> str:
    """OpenAI message content (a string, None, or a list of text parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                out.append(part)
                continue
            if not isinstance(part, dict):
                raise RenderError(f"{param}[{i}] must be an object", f"{param}[{i}]")
            kind = part.get("type")
            if kind in ("text", "input_text", "output_text", "reasoning_text", "summary_text") and isinstance(
                part.get("text"), str
            ):
                out.append(part["text"])
            else:
                raise RenderError(
                    f"{param}[{i}]: content part type {kind!r} is not supported by this model (text only)",
                    f"{param}[{i}].type",
                )
        return "".join(out)
    raise RenderError(f"{param} must be a string or a list of content parts", param)


# Text that openai-harmony tokenizes itself (instructions, tool descriptions and schemas; message bodies go through
# tiktoken, see `Renderer._render`) may not hold a run of more non-space characters than this: harmony's tokenizer is
# quadratic in one regex piece and holds the GIL (40,000 characters: 0.55 s).
MAX_HARMONY_WORD = 8192


def _check_words(text: str, param: str) -> None:
    """Reject a run of more than MAX_HARMONY_WORD non-space characters (linear: finds the longest run)."""
    if len(text) > MAX_HARMONY_WORD and max(map(len, re.split(r"\s+", text))) > MAX_HARMONY_WORD:
        raise RenderError(
            f"{param} holds a run of more than {MAX_HARMONY_WORD} characters without whitespace; "
            "put such data in a user message",
            param,
        )


def parse_chat_tools(tools: Any, tool_choice: Any) -> list[Tool]:
    """OpenAI `tools` + `tool_choice` -> the function tools to render (`none` renders none)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RenderError("'tools' must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise RenderError(f"tools[{i}]: only type 'function' tools are supported", f"tools[{i}].type")
        fn = t.get("function", t)  # chat nests under "function"; Responses is flat
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_\-\.]{1,64}", name):
            raise RenderError(f"tools[{i}]: invalid function name {name!r}", f"tools[{i}].function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise RenderError(
                f"tools[{i}]: 'parameters' must be a JSON schema object", f"tools[{i}].function.parameters"
            )
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise RenderError(f"tools[{i}]: 'description' must be a string", f"tools[{i}].function.description")
        _check_words(description, f"tools[{i}].function.description")
        _check_words(json.dumps(params) if params else "", f"tools[{i}].function.parameters")
        out.append(Tool(name, description, params))
    if tool_choice is None or tool_choice in ("auto", "required"):
        return out
    if tool_choice == "none":
        return []
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if fn is not None and not isinstance(fn, dict):
            raise RenderError("tool_choice.function must be an object with a 'name'", "tool_choice.function")
        name = (fn or {}).get("name") or tool_choice.get("name")
        chosen = [t for t in out if t.name == name]
        if not chosen:
            raise RenderError(f"tool_choice names function {name!r}, which is not in 'tools'", "tool_choice")
        return chosen
    raise RenderError(f"Invalid value for 'tool_choice': {tool_choice!r}", "tool_choice")


@dataclasses.dataclass
class _Msg:
    """One harmony message to render (our neutral form, converted to openai_harmony at the end)."""

    role: str  # system-instructions | user | assistant | tool
    text: str = ""
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None
    author: str | None = None  # tool messages: functions.NAME


class Renderer:
    """Renders chat messages / Responses input into harmony prompt token ids. `tokenizer`: the o200k_harmony
    `tiktoken.Encoding` that encodes message bodies (default: `tokenizer.load()`)."""

    def __init__(
        self, conversation_start_date: str | None = None, model_identity: str | None = None, tokenizer: Any = None
    ):
        self.enc = load_encoding()
        self.tok = tokenizer if tokenizer is not None else tokenizer_lib.load()
        self.conversation_start_date = conversation_start_date
        self.model_identity = model_identity

    # ---- public entry points -------------------------------------------------------------------
    def render_chat(self, messages: Any, tools: list[Tool], reasoning_effort: str) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise RenderError("'messages' must be a non-empty list", "messages")
        return self._render(self._chat_to_msgs(messages), tools, reasoning_effort)

    def render_responses(
        self, input_: Any, instructions: str | None, tools: list[Tool], reasoning_effort: str
    ) -> list[int]:
        msgs = []
        if instructions:
            _check_words(instructions, "instructions")
            msgs.append(_Msg("instructions", instructions))
        msgs += self._responses_to_msgs(input_)
        return self._render(msgs, tools, reasoning_effort)

    # ---- OpenAI chat -> neutral messages -------------------------------------------------------
    def _chat_to_msgs(self, messages: list) -> list[_Msg]:
        call_names: dict[str, str] = {}
        # Chain of thought is kept only for assistant messages of the unfinished turn: those after the
        # last assistant message that ended in a final answer (a tool loop in progress keeps its CoT).
        last_final = -1
        for i, m in enumerate(messages):
            if (
                isinstance(m, dict)
                and m.get("role") == "assistant"
                and not m.get("tool_calls")
                and _text_of(m.get("content"), f"messages[{i}].content")
            ):
                last_final = i
        out: list[_Msg] = []
        for i, m in enumerate(messages):
            p = f"messages[{i}]"
            if not isinstance(m, dict):
                raise RenderError(f"{p} must be an object", p)
            role = m.get("role")
            if role in ("system", "developer"):
                out.append(_Msg("instructions", _text_of(m.get("content"), f"{p}.content")))
                _check_words(out[-1].text, f"{p}.content")
            elif role == "user":
                out.append(_Msg("user", _text_of(m.get("content"), f"{p}.content")))
            elif role == "assistant":
                text = _text_of(m.get("content"), f"{p}.content")
                reasoning = next(
                    (
                        m[k]
                        for k in ("reasoning_content", "reasoning", "thinking")
                        if isinstance(m.get(k), str) and m[k]
                    ),
                    None,
                )
                tool_calls = m.get("tool_calls") or []
                if not isinstance(tool_calls, list):
                    raise RenderError(f"{p}.tool_calls must be a list", f"{p}.tool_calls")
                if reasoning and i > last_final:
                    out.append(_Msg("assistant", reasoning, channel="analysis"))
                if tool_calls:
                    if text:
                        out.append(_Msg("assistant", text, channel="commentary"))  # a preamble
                    for j, tc in enumerate(tool_calls):
                        fn = tc.get("function") if isinstance(tc, dict) else None
                        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                            raise RenderError(f"{p}.tool_calls[{j}] needs function.name", f"{p}.tool_calls[{j}]")
                        args = fn.get("arguments", "")
                        if not isinstance(args, str):
                            args = json.dumps(args)
                        if not isinstance(tc.get("id", ""), str):
                            raise RenderError(f"{p}.tool_calls[{j}].id must be a string", f"{p}.tool_calls[{j}].id")
                        if tc.get("id"):
                            call_names[tc["id"]] = fn["name"]
                        out.append(
                            _Msg(
                                "assistant",
                                args,
                                channel="commentary",
                                recipient=f"functions.{fn['name']}",
                                content_type="<|constrain|>json",
                            )
                        )
                elif text or not reasoning:
                    out.append(_Msg("assistant", text, channel="final"))
            elif role in ("tool", "function"):
                call_id = m.get("tool_call_id")
                if call_id is not None and not isinstance(call_id, str):
                    raise RenderError(f"{p}.tool_call_id must be a string", f"{p}.tool_call_id")
                name = m.get("name") or call_names.get(call_id)
                if not isinstance(name, str):
                    raise RenderError(
                        f"{p}: cannot tell which function this result belongs to: give 'name' or a "
                        "'tool_call_id' of an earlier assistant tool call",
                        f"{p}.tool_call_id",
                    )
                out.append(
                    _Msg(
                        "tool",
                        _text_of(m.get("content"), f"{p}.content"),
                        channel="commentary",
                        recipient="assistant",
                        author=f"functions.{name}",
                    )
                )
            else:
                raise RenderError(
                    f"{p}.role {role!r} is not one of system, developer, user, assistant, tool", f"{p}.role"
                )
        return out

    # ---- Responses input -> neutral messages ---------------------------------------------------
    def _responses_to_msgs(self, input_: Any) -> list[_Msg]:
        if isinstance(input_, str):
            return [_Msg("user", input_)]
        if not isinstance(input_, list) or not input_:
            raise RenderError("'input' must be a string or a non-empty list of items", "input")
        items = input_
        call_names: dict[str, str] = {}
        # Reasoning items are replayed only after the last assistant message while a tool loop is open.
        last_assistant = max(
            (
                i
                for i, it in enumerate(items)
                if isinstance(it, dict) and it.get("type", "message") == "message" and it.get("role") == "assistant"
            ),
            default=-1,
        )
        in_tool_loop = isinstance(items[-1], dict) and items[-1].get("type") == "function_call_output"
        out: list[_Msg] = []
        for i, it in enumerate(items):
            p = f"input[{i}]"
            if not isinstance(it, dict):
                raise RenderError(f"{p} must be an object", p)
            kind = it.get("type", "message")
            if kind == "message":
                role = it.get("role")
                text = _text_of(it.get("content"), f"{p}.content")
                if role in ("system", "developer"):
                    _check_words(text, f"{p}.content")
                    out.append(_Msg("instructions", text))
                elif role == "user":
                    out.append(_Msg("user", text))
                elif role == "assistant":
                    out.append(_Msg("assistant", text, channel="final"))
                else:
                    raise RenderError(f"{p}.role {role!r} is not supported", f"{p}.role")
            elif kind == "reasoning":
                if in_tool_loop and i > last_assistant:
                    text = _text_of(it.get("content") or [], f"{p}.content")
                    if text:
                        out.append(_Msg("assistant", text, channel="analysis"))
            elif kind == "function_call":
                name, args = it.get("name"), it.get("arguments", "")
                if not isinstance(name, str) or not isinstance(args, str):
                    raise RenderError(f"{p}: function_call needs string 'name' and 'arguments'", p)
                if not isinstance(it.get("call_id", ""), str):
                    raise RenderError(f"{p}.call_id must be a string", f"{p}.call_id")
                call_names[it.get("call_id", "")] = name
                out.append(
                    _Msg(
                        "assistant",
                        args,
                        channel="commentary",
                        recipient=f"functions.{name}",
                        content_type="<|constrain|>json",
                    )
                )
            elif kind == "function_call_output":
                if not isinstance(it.get("call_id", ""), str):
                    raise RenderError(f"{p}.call_id must be a string", f"{p}.call_id")
                name = call_names.get(it.get("call_id", ""))
                if name is None:
                    raise RenderError(f"{p}: call_id {it.get('call_id')!r} matches no earlier function_call", p)
                output = it.get("output", "")
                out.append(
                    _Msg(
                        "tool",
                        output if isinstance(output, str) else json.dumps(output),
                        channel="commentary",
                        recipient="assistant",
                        author=f"functions.{name}",
                    )
                )
            else:
                raise RenderError(f"{p}.type {kind!r} is not supported", f"{p}.type")
        return out

    # ---- neutral messages -> harmony tokens ----------------------------------------------------
    def _render(self, msgs: list[_Msg], tools: list[Tool], effort: str) -> list[int]:
        """openai-harmony renders the frame (system and developer messages, headers); the bodies of user, assistant
        and tool messages are left empty there and encoded here with tiktoken, which gives the same tokens (a body
        is encoded on its own, specials as plain text) in linear time and without the GIL, where harmony's own
        tokenizer is quadratic in one long regex piece (160k x 'a': 9.5 s holding the event loop)."""
        bodies = [m.text if m.role != "instructions" else "" for m in msgs]
        frame = self._render_frame(
            [dataclasses.replace(m, text="") if b else m for m, b in zip(msgs, bodies)], tools, effort
        )
        # Leading instructions merge into one developer message, so the last len(msgs) - k messages are msgs[k:].
        k = next((i for i, m in enumerate(msgs) if m.role != "instructions"), len(msgs))
        starts = [i for i, t in enumerate(frame) if t == MESSAGE]
        out, prev = [], 0
        for body, at in zip(bodies[k:], starts[len(starts) - (len(msgs) - k) :]):
            if body:
                out += frame[prev : at + 1]
                out += self.tok.encode_ordinary(body)
                prev = at + 1
        return out + frame[prev:]

    def _render_frame(self, msgs: list[_Msg], tools: list[Tool], effort: str) -> list[int]:
        import openai_harmony as oh
        from openai_harmony import ReasoningEffort, RenderConversationConfig

        system = oh.SystemContent.new().with_reasoning_effort(
            {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM, "high": ReasoningEffort.HIGH}[effort]
        )
        if self.conversation_start_date:
            system = system.with_conversation_start_date(self.conversation_start_date)
        if self.model_identity:
            system = system.with_model_identity(self.model_identity)
        out = [oh.Message.from_role_and_content(oh.Role.SYSTEM, system)]
        # Leading system/developer messages become the developer message's instructions (all of them,
        # in order); later ones stay where they are as further developer messages. Tools go in the first.
        k = 0
        leading = []
        while k < len(msgs) and msgs[k].role == "instructions":
            leading.append(msgs[k].text)
            k += 1
        instructions = "\n\n".join(t for t in leading if t)
        if instructions or tools:
            dev = oh.DeveloperContent.new()
            if instructions:
                dev = dev.with_instructions(instructions)
            if tools:
                dev = dev.with_function_tools(
                    [oh.ToolDescription.new(t.name, t.description, parameters=t.parameters) for t in tools]
                )
            out.append(oh.Message.from_role_and_content(oh.Role.DEVELOPER, dev))
        for m in msgs[k:]:
            if m.role == "instructions":
                out.append(
                    oh.Message.from_role_and_content(
                        oh.Role.DEVELOPER, oh.DeveloperContent.new().with_instructions(m.text)
                    )
                )
                continue
            if m.role == "tool":
                msg = oh.Message.from_author_and_content(oh.Author.new(oh.Role.TOOL, m.author), m.text)
            else:
                msg = oh.Message.from_role_and_content(oh.Role.USER if m.role == "user" else oh.Role.ASSISTANT, m.text)
            if m.channel:
                msg = msg.with_channel(m.channel)
            if m.recipient:
                msg = msg.with_recipient(m.recipient)
            if m.content_type:
                msg = msg.with_content_type(m.content_type)
            out.append(msg)
        convo = oh.Conversation.from_messages(out)
        return list(
            self.enc.render_conversation_for_completion(
                convo, oh.Role.ASSISTANT, RenderConversationConfig(auto_drop_analysis=False)
            )
        )


# ---------------------------------------------------------------------------------------------------
# Output parsing
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Delta:
    """One piece of parsed output. kind: reasoning | content | tool_start | tool_args."""

    kind: str
    text: str = ""
    tool_index: int = -1
    name: str | None = None
    token: int | None = None  # content of a header that was plain text: the index of the token that ends the piece


class _Utf8:
    """Incremental token-bytes -> text; holds back incomplete UTF-8 sequences."""

    def __init__(self):
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, b: bytes) -> str:
        return self.dec.decode(b)

    def flush(self) -> str:
        return self.dec.decode(b"", final=True)


class OutputParser:
    """Tolerant streaming parser of one generated harmony reply (the prompt ended in `<|start|>assistant`).

    `process(token_id)` returns the deltas that token completes; `finish()` flushes what is held back.
    The concatenation of all deltas is the response: streaming and non-streaming share this path.
    """

    def __init__(self, tokenizer, tool_names: Iterable[str] = ()):
        self.tok = tokenizer
        self.tool_names = set(tool_names)
        self.state = "header"  # header | content | between
        self.header: list[int] = []  # always the last tokens processed
        self.num_tokens = 0  # tokens processed
        self.kind: str | None = None  # destination of the current message's content
        self.utf8 = _Utf8()
        self.num_tool_calls = 0
        self.num_reasoning_tokens = 0
        self.last_token_kind: str | None = None  # what the last processed token was part of

    # ---- helpers -------------------------------------------------------------------------------
    def _bytes(self, t: int) -> bytes:
        if t >= FIRST_SPECIAL:
            return b""
        try:
            return self.tok.decode_single_token_bytes(t)
        except KeyError:
            return b""

    def _header_text(self, keep_markers: bool) -> str:
        parts = []
        for t in self.header:
            if t == CHANNEL:
                parts.append("<|channel|>" if keep_markers else " ")
            elif t == CONSTRAIN:
                parts.append("<|constrain|>" if keep_markers else " ")
            elif t >= FIRST_SPECIAL:
                parts.append(" " if keep_markers else "")
            else:
                parts.append(self._bytes(t).decode("utf-8", errors="replace"))
        return "".join(parts)

    def _classify(self) -> list[Delta]:
        """Header complete (`<|message|>` seen): pick the destination of the content."""
        text = self._header_text(keep_markers=True)
        role_part, has_channel, rest = text.partition("<|channel|>")
        m = re.search(r"to=([^\s<]+)", text)
        recipient = m.group(1) if m else None
        channel = None
        if has_channel:
            cm = re.match(r"\s*([A-Za-z_]+)", rest)
            channel = cm.group(1) if cm else None
        self.header = []
        self.state = "content"
        self.utf8 = _Utf8()
        name = None
        if recipient and recipient.startswith("functions."):
            name = recipient[len("functions.") :]
        elif recipient and recipient in self.tool_names:
            name = recipient
        if name:
            self.kind = "tool_args"
            idx = self.num_tool_calls
            self.num_tool_calls += 1
            return [Delta("tool_start", tool_index=idx, name=name)]
        if recipient and recipient not in ("assistant", "user", "all"):
            self.kind = "reasoning"  # a built-in tool call (browser.*, python): internal, not an answer
        else:
            self.kind = "reasoning" if channel == "analysis" else "content"
        return []

    def _emit(self, text: str) -> list[Delta]:
        if not text:
            return []
        if self.kind == "tool_args":
            return [Delta("tool_args", text, tool_index=self.num_tool_calls - 1)]
        return [Delta(self.kind or "content", text)]

    def _headerless_to_content(self, end: int) -> list[Delta]:
        """Flush a header that turned out to be plain text (no channel, no recipient) into content, its tokens
        ending before token `end`: a piece per token, naming it (`Delta.token`), so that the caller attaches each
        token's log-probability and finds a stop string at the token where it ends."""
        text = self._header_text(keep_markers=True)
        header, self.header = self.header, []
        if "<|channel|>" in text or "to=" in text or not self._header_text_of(header):
            return []
        first, utf8 = end - len(header), _Utf8()
        out = [Delta("content", utf8.push(self._bytes(t)), token=first + i) for i, t in enumerate(header)]
        out[-1].text += utf8.flush()
        return out

    def _header_text_of(self, header: list[int]) -> str:
        return b"".join(self._bytes(t) for t in header).decode("utf-8", errors="replace")

    def _end_message(self) -> list[Delta]:
        out = self._emit(self.utf8.flush()) if self.state == "content" else []
        self.utf8 = _Utf8()
        self.kind = None
        return out

    # ---- public --------------------------------------------------------------------------------
    def process(self, t: int) -> list[Delta]:
        t = int(t)
        self.num_tokens += 1
        out: list[Delta] = []
        if self.state == "header":
            self.last_token_kind = "header"
            if t == MESSAGE:
                return self._classify()
            if t == START:  # a restarted message: drop the partial header (keep plain text)
                return self._headerless_to_content(self.num_tokens - 1)
            if t in (END, RETURN, CALL, ENDOFTEXT):
                out = self._headerless_to_content(self.num_tokens - 1)
                self.state = "between"
                return out
            self.header.append(t)
            if len(self.header) > MAX_HEADER_TOKENS:
                # No `<|message|>` in sight: this is text without a header. Show it as content.
                out = self._headerless_to_content(self.num_tokens)
                self.state, self.kind, self.utf8 = "content", "content", _Utf8()
            return out
        if self.state == "content":
            if t in (END, RETURN, CALL, ENDOFTEXT):
                self.last_token_kind = "control"
                out = self._end_message()
                self.state = "between"
                return out
            if t in (START, CHANNEL):  # a new message began without closing this one
                self.last_token_kind = "control"
                out = self._end_message()
                self.state = "header"
                self.header = [t] if t == CHANNEL else []
                return out
            self.last_token_kind = self.kind
            if t >= FIRST_SPECIAL:
                return []  # stray control tokens never reach the text
            if self.kind == "reasoning":
                self.num_reasoning_tokens += 1
            return self._emit(self.utf8.push(self._bytes(t)))
        # between messages: expect <|start|>; anything else begins a header-less message
        self.last_token_kind = "header"
        if t == START:
            self.state, self.header = "header", []
        elif t not in (END, RETURN, CALL, ENDOFTEXT, MESSAGE):
            self.state, self.header = "header", [t] if t == CHANNEL or t < FIRST_SPECIAL else []
        return out

    def finish(self) -> list[Delta]:
        """End of generation: flush held-back bytes or a header that never completed."""
        if self.state == "content":
            out = self._end_message()
        elif self.state == "header":
            out = self._headerless_to_content(self.num_tokens)
        else:
            out = []
        self.state = "between"
        return out


class TextDetokenizer:
    """Raw completion text (special tokens skipped), UTF-8 safe across token boundaries."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.utf8 = _Utf8()

    def process(self, t: int) -> str:
        if t >= FIRST_SPECIAL:
            return ""
        try:
            return self.utf8.push(self.tok.decode_single_token_bytes(int(t)))
        except KeyError:
            return ""

    def finish(self) -> str:
        return self.utf8.flush()


class StopStrings:
    """Applies `stop` strings to a text stream, holding back only what could still start a match."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buf = ""
        self.hit = False

    def push(self, text: str, match: bool = True) -> str:
        """The text that can be released; `match=False` (before min_tokens) releases it all unmatched."""
        if not self.stops or self.hit:
            return "" if self.hit else text
        if not match:
            out, self.buf = self.buf + text, ""
            return out
        self.buf += text
        found = [(self.buf.find(s), s) for s in self.stops if s in self.buf]
        if found:
            pos = min(p for p, _ in found)
            out, self.buf, self.hit = self.buf[:pos], "", True
            return out
        cut = len(self.buf) - self.hold
        if cut <= 0:
            return ""
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out

    def flush(self) -> str:
        out, self.buf = ("" if self.hit else self.buf), ""
        return out
