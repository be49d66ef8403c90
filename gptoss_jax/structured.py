"""Structured outputs: a request's constraint (JSON schema, JSON object, regex, choice, grammar, a tool call) compiled
with llguidance into a token matcher, and the per-sequence state that decides, token by token, what the sampler may
draw next.

On gpt-oss the constraint shapes the answer, never the reasoning. A constrained reply is
    <|channel|>analysis<|message|> FREE TEXT <|end|><|start|>assistant  (the reasoning, optional)
    ANSWER                                                                (under the grammar)
where ANSWER is `<|channel|>final<|message|>CONTENT<|return|>` or, for tool calls,
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGUMENTS<|call|>`: the grammar covers the
answer's harmony header and its stop token, so the output always parses. The reasoning runs free (unmasked,
multi-step on device, asynchronous); the host watches it and cuts it when it leaves the analysis message or
exceeds the reasoning budget (`thinking_token_budget`), force-feeding the tokens that close it. In the answer a
"gated" sequence draws the first token of its next engine call under the bitmask the matcher computed from the
tokens before it (`Constraint.mask`); the call's later steps draw freely, and the host keeps them while the grammar
accepts them (`Constraint._answer`). A row whose tokens are still in flight draws freely in the next call too (its
mask depends on them), so it joins every call asynchronously like the other rows; a rejection voids that call.
Inside a JSON string the mask does not change from one content token to the next, so there a row's mask also holds
at the call's later steps and through the tokens in flight, for as long as every token since is string content
(`Gate`; the device checks it, `sampling.mask_applies`): the draws there cannot be rejected.

Why llguidance (docs/BENCHMARKS.md §11): it reads tiktoken encodings directly, ships abi3 wheels without torch,
computes masks lazily over the 201k vocabulary in tens of microseconds and compiles schemas in milliseconds
(xgrammar needs torch; outlines-core builds a full index per schema, seconds for non-trivial ones).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import re
from typing import Any

import numpy as np

from gptoss_jax.tokenizer import CALL, CHANNEL, END, ENDOFTEXT, MESSAGE, RETURN, START

FIRST_SPECIAL = 199998  # o200k_harmony: every id from here on is a special token
ANALYSIS, ASSISTANT = 35644, 173781  # "analysis", "assistant" (single tokens of o200k)
CLOSE_REASONING = (END, START, ASSISTANT)  # ends the analysis message and opens the next assistant message


@dataclasses.dataclass
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams`: exactly one of `json` (a JSON schema, dict or string), `regex`, `choice`
    (a list of strings), `grammar` (Lark, or GBNF/EBNF) or `json_object=True`; and, gpt-oss's own, `tools`:
    `(name, parameters schema or None)` pairs whose calls are allowed answers (alone: the answer must be one of
    these calls, as `tool_choice` "required" or a named function asks; with a content constraint: the answer is that
    content or one of these calls). `strict=False` ignores JSON-schema keywords the engine does not implement
    (`strict=True`, the default, rejects them)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    tools: tuple[tuple[str, dict | None], ...] | list | None = None
    strict: bool = True

    def __post_init__(self):
        kinds = [
            k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k) not in (None, False)
        ]
        if len(kinds) > 1:
            raise ValueError(
                f"StructuredOutputsParams: give one of json, regex, choice, grammar, json_object; got {kinds}"
            )
        if not kinds and not self.tools:
            raise ValueError("StructuredOutputsParams: no constraint given (json, regex, choice, grammar, json_object)")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError("StructuredOutputsParams.json must be a JSON schema (an object)")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("StructuredOutputsParams.regex must be a string")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("StructuredOutputsParams.grammar must be a string")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError("StructuredOutputsParams.choice must be a non-empty list of strings")
            if any(not isinstance(c, str) for c in self.choice):
                raise ValueError("StructuredOutputsParams.choice must hold strings only")
            self.choice = tuple(self.choice)
        tools = []
        for t in self.tools or ():
            name, params = t if isinstance(t, (list, tuple)) else (t, None)
            if not isinstance(name, str) or not name or (params is not None and not isinstance(params, dict)):
                raise ValueError(f"StructuredOutputsParams.tools: {t!r} is not a (name, parameters schema) pair")
            tools.append((name, params))
        self.tools = tuple(tools) or None

    def lark(self) -> str:
        """The llguidance grammar (JSON form) of the answer message, harmony header and stop token included."""
        answers, subs = [], []
        if self.json is not None or self.json_object:
            schema = self.json if self.json is not None else {"type": "object"}
            answers.append(f"<|channel|> {_lit('final')} <|message|> %json {_schema(schema, self.strict)} <|return|>")
        elif self.regex is not None:
            subs.append({"name": "content", "lark_grammar": f"start: /{_regex_to_lark(self.regex)}/"})
        elif self.choice is not None:
            subs.append({"name": "content", "lark_grammar": "start: " + " | ".join(_lit(c) for c in self.choice)})
        elif self.grammar is not None:
            subs.append({"name": "content", "lark_grammar": _to_lark(self.grammar)})
        if subs:
            answers.append(f"<|channel|> {_lit('final')} <|message|> @content <|return|>")
        for name, params in self.tools or ():
            header = _lit(f"commentary to=functions.{name} ")
            args = _schema(params if params is not None else {"type": "object"}, self.strict)
            answers.append(f"<|channel|> {header} <|constrain|> {_lit('json')} <|message|> %json {args} <|call|>")
        main = "start: " + " | ".join(f"({a})" for a in answers)
        return json.dumps({"grammars": [{"lark_grammar": main}, *subs]})


def _lit(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text)


def _schema(schema: Any, strict: bool) -> str:
    """The schema for `%json`: compact JSON (no free whitespace between tokens: a model cannot pad forever) and,
    unless strict, unknown keywords ignored."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    options = {"whitespace_flexible": False, "lenient": not strict}
    return json.dumps({**schema, "x-guidance": {**options, **schema.get("x-guidance", {})}})


def _regex_to_lark(regex: str) -> str:
    import llguidance

    return llguidance.regex_to_lark(regex, "")


def _to_lark(grammar: str) -> str:
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(grammar)
    except Exception as e:  # noqa: BLE001 - the library raises plain exceptions for bad grammars
        raise ValueError(f"cannot read the grammar (Lark or GBNF): {e}") from None


@functools.cache
def ll_tokenizer(encoding):
    """The llguidance tokenizer of a tiktoken encoding (~1 s to build: once per encoding). Its end-of-sequence token
    is `<|endoftext|>`, which no grammar here uses: the answers' own stop tokens are ordinary grammar tokens, which
    `try_consume_tokens` checks like any other (it never consumes the end-of-sequence token)."""
    import llguidance
    import llguidance.tiktoken

    return llguidance.tiktoken.lltokenizer_from_encoding(encoding, eos_token=ENDOFTEXT)


def compile_grammar(params: StructuredOutputsParams, encoding) -> str:
    """The grammar of `params`, checked: a `ValueError` names what is wrong (a schema keyword, a regex error)."""
    import llguidance

    try:
        grammar = params.lark()
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - llguidance's converters raise their own types
        raise ValueError(str(e)) from None
    error = llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer(encoding))
    if error:
        raise ValueError(_first_line(error))
    return grammar


def _first_line(error: str) -> str:
    """llguidance's message without the position in our generated grammar (`at 1(8): `) and its excerpt of it."""
    lines = []
    for line in error.strip().splitlines():
        if re.match(r"\s*\d+ \| ", line):
            break
        if line.strip() and line.strip() != "^":
            lines.append(line.strip())
    text = " ".join(lines)
    return re.sub(r"^at \d+\(\d+\): ", "", text)


# Within this many tokens of its length limit a constrained answer is closed (`Constraint._fast_forward`):
# room for the closing brackets of a JSON value nested some levels deep and the stop token.
CLOSING_RESERVE = 24
# What ends a value soonest, in order of preference, inside a JSON string and outside: after the stop tokens, closing
# quotes and brackets, then the shortest values (a string opened here is closed by the quote at the next step; "1"
# before "0": a bounded decimal may not end in 0).
CLOSERS_IN_STRING = ('"}', '"]', '",', '"')
CLOSERS = ("}", "]", ",", "1", "0", "true", "null", '"', "{", "[")


@functools.cache
def _closers(encoding) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`CLOSERS` and `CLOSERS_IN_STRING` (those that are one token of `encoding`, all of them in o200k) as token ids,
    the stop tokens first: (outside a string, inside one)."""

    def ids(texts):
        return (RETURN, CALL, *(t[0] for t in map(encoding.encode_ordinary, texts) if len(t) == 1))

    return ids(CLOSERS), ids(CLOSERS_IN_STRING)


def mask_words(vocab_size: int) -> int:
    """int32 words of a packed token bitmask: bit `t % 32` of word `t // 32` allows token t."""
    return -(-vocab_size // 32)


def _bit(words: np.ndarray, t: int) -> bool:
    return bool(words[t // 32] >> (t % 32) & 1)


# How many tokens after its position a held mask can reach: the device reads them back from the sampler state's
# `recent_SR` (at least this many columns).
MAX_HELD = 8
_NOT_CONTENT = re.compile(rb'["\\\x00-\x1f]')


@functools.cache
def stay_tokens(encoding, vocab_size: int) -> np.ndarray:
    """The packed bitmask (`mask_words`) of JSON string content: tokens of whole UTF-8 characters without a quote, a
    backslash or a control character. Inside a plain JSON string the grammar's mask is the same after any of them,
    so a mask can hold across them (`Gate`); ~0.2 s for o200k, once per encoding."""
    bits = np.zeros(mask_words(vocab_size) * 32, bool)
    ranks = getattr(encoding, "_mergeable_ranks", None)  # tiktoken's own table of every ordinary token: at once
    if ranks is None:  # the public way, 0.2 s more
        ranks = {b: encoding.encode_single_token(b) for b in encoding.token_byte_values()}
    for token_bytes, t in ranks.items():
        if t < vocab_size and _NOT_CONTENT.search(token_bytes) is None:
            try:
                token_bytes.decode("utf-8")
            except UnicodeDecodeError:
                continue
            bits[t] = True
    return np.packbits(bits.reshape(-1, 32), axis=-1, bitorder="little").view(np.int32)[:, 0]


@dataclasses.dataclass(frozen=True)
class Gate:
    """The mask a call applied to one row: `mask`, computed for the token at `position`; where `holds` (the row was in
    a JSON string), also at the positions after it for as long as every token since is allowed by `mask` and is one
    of `stay` (`stay_tokens`), up to `MAX_HELD` of them. The device decides it the same way (`sampling.mask_applies`),
    from the tokens it fed."""

    mask: np.ndarray
    position: int
    holds: bool
    stay: np.ndarray | None = None

    def applies(self, position: int, before: collections.deque) -> bool:
        """Whether the token at `position` was drawn under `mask`; `before` ends with the tokens before it."""
        k = position - self.position
        if k == 0:
            return True
        if k < 0 or not self.holds or k > MAX_HELD or k > len(before):
            return False
        return all(_bit(self.mask, t) and _bit(self.stay, t) for t in list(before)[-k:])


class Constraint:
    """One sequence's structured-output state. `accept(tokens)` reads the tokens a call sampled for it and says how
    many to keep and which to force-feed after them; `gated` sequences draw the first token of a call dispatched after
    `accept` under `mask` (a packed bitmask of the model's vocabulary, refreshed by `accept`).

    `grammar=None` with a budget only limits the reasoning (the answer is then free). A `prompt` that ends in the
    analysis header (an assistant message the caller opened) starts in the reasoning. `max_len`: the sequence's
    length limit (prompt included); within `CLOSING_RESERVE` tokens of it the answer is steered to its end."""

    def __init__(self, grammar: str | None, encoding, budget: int, vocab_size: int, prompt: list[int], max_len: int):
        import llguidance

        tok = ll_tokenizer(encoding)
        self.matcher = llguidance.LLMatcher(tok, grammar) if grammar is not None else None
        if self.matcher is not None and self.matcher.is_error():
            raise ValueError(_first_line(self.matcher.get_error()))
        self.budget = budget
        self.phase = "header"  # header (of the analysis message) | reasoning | answer | done
        self.num_header = 0  # analysis-header tokens seen
        self.num_reasoning = 0  # analysis body tokens kept
        self.need_mask = True  # in the answer: the next token must be drawn under `mask`
        self.length, self.max_len = len(prompt), max_len
        self.closers = _closers(encoding)
        self.encoding = encoding
        self.in_string = self.escaped = False  # where the answer's text is, as JSON (for `_closer` and `gate`)
        self.recent = collections.deque(maxlen=MAX_HELD)  # the last answer tokens (for `Gate.applies`)
        self.stay = stay_tokens(encoding, vocab_size) if self.matcher is not None else None
        if tuple(prompt[-3:]) == (CHANNEL, ANALYSIS, MESSAGE):
            self.phase, self.num_header = "reasoning", 3
        self.words = mask_words(vocab_size)
        self._buffer = np.zeros(max(self.words, mask_words(tok.vocab_size)), np.int32)
        self.mask = self._buffer[: self.words]
        self._mask_at = -1  # the position `mask` was computed for

    def _compute_mask(self) -> None:
        if self._mask_at != self.length:
            self.matcher.unsafe_compute_mask_ptr(self._buffer.ctypes.data, self._buffer.nbytes)
            self._mask_at = self.length

    @property
    def gated(self) -> bool:
        """Whether the next token must be drawn under `mask` (after a rejected token, and where the answer starts)."""
        return self.phase == "answer" and self.matcher is not None and self.need_mask

    def gate(self, pending: bool, holds: bool) -> Gate | None:
        """The mask of the row's next call, if any: where the row is `gated` and has no tokens in flight (`pending`),
        for its first sampled token; with `holds` (calls that allow it: not speculative ones) and inside a JSON
        string, also for the later ones and across the tokens in flight while they stay in the string."""
        if self.phase != "answer" or self.matcher is None:
            return None
        holds = holds and self.in_string and self._mask_at == self.length
        if holds or (self.need_mask and not pending):
            return Gate(self.mask.copy(), self.length, holds, self.stay)
        return None

    def accept(self, tokens: list[int], gate: Gate | None = None) -> tuple[int, list[int]]:
        """Feed sampled `tokens` in order (drawn under `gate`, if the call had one for this row): `(how many to keep,
        tokens to force after them)`. The tokens after the kept ones are dropped: sampled past the point where the
        reasoning had to end, or the first answer token the grammar rejects and those after it."""
        for i, t in enumerate(tokens):
            if self.phase == "answer" and self.matcher is not None:
                return self._answer(tokens, i, gate)
            if self.phase in ("answer", "done"):  # a free answer (budget only), or past the grammar's end
                return len(tokens), []
            step = self._reasoning(t)
            if step is not None:
                keep, forced = step
                self.length += keep
                return i + keep, forced
            self.length += 1
        return len(tokens), []

    def _answer(self, tokens: list[int], start: int, gate: Gate | None) -> tuple[int, list[int]]:
        """Answer tokens, each drawn under the call's mask where `gate` applies, else freely. Each is kept while the
        grammar accepts it: a token drawn freely and kept is a draw from the masked distribution (rejection sampling,
        exact for temperature alone; with top-k/top-p the filters then act before the mask rather than after). So is
        one drawn under a held mask that allows every token this state's mask allows (a superset; in an enum's string,
        whose content narrows the mask, it does not, and the token is dropped whatever it is). At the first token not
        kept the row is gated again: the rest is dropped, and the next token is drawn under the mask of the state
        after the kept ones (and the tokens the grammar forces there)."""
        m = self.matcher
        n = start
        for t in tokens[start:]:
            if gate is not None and self.length > gate.position and gate.applies(self.length, self.recent):
                self._compute_mask()
                if np.any(self.mask & ~gate.mask):
                    break
            if m.try_consume_tokens([t]) != 1:
                break
            self.length += 1
            self._track(t)
            n += 1
            if m.is_stopped():
                self.phase = "done"
                return n, []
        if n < len(tokens) or self.max_len - self.length <= CLOSING_RESERVE:
            self.need_mask = True
            return n, self._fast_forward()
        self.need_mask = False
        if self.in_string:  # the mask a held gate needs
            self._compute_mask()
        return n, []

    def _reasoning(self, t: int) -> tuple[bool, list[int]] | None:
        """One token of the analysis message: None to go on, else (keep the token, tokens to force)."""
        if self.phase == "header":
            expected = (CHANNEL, ANALYSIS, MESSAGE)[self.num_header]
            if t == expected:
                self.num_header += 1
                if self.num_header == 3:
                    self.phase = "reasoning"
                return None
            if self.num_header == 0:  # no reasoning: the answer starts here, under the grammar
                return False, self._enter_answer(())
            self.phase = "reasoning"  # a malformed header: complete it, the reasoning goes on
            forced = list((CHANNEL, ANALYSIS, MESSAGE)[self.num_header :])
            self.length += len(forced)
            return False, forced
        if t == END:
            return True, self._enter_answer(CLOSE_REASONING[1:])
        if t >= FIRST_SPECIAL or self.num_reasoning >= self.budget:
            return False, self._enter_answer(CLOSE_REASONING)
        self.num_reasoning += 1
        return None

    def _enter_answer(self, forced: tuple[int, ...]) -> list[int]:
        self.phase = "answer"
        self.length += len(forced)
        return list(forced) + (self._fast_forward() if self.matcher is not None else [])

    def _fast_forward(self) -> list[int]:
        """Tokens the grammar forces from here (a header, a key), consumed; stop tokens are left to the sampler, so
        that the engine's stop logic sees them. Then the mask of the token after. Within `CLOSING_RESERVE` tokens of
        the length limit, the closers that end the answer soonest are forced too, all of them at once (each call then
        feeds them, a token a step, instead of drawing one under a mask and waiting for the host)."""
        forced = self._forced()
        while not self.matcher.is_stopped():
            self._compute_mask()
            if self.max_len - self.length > CLOSING_RESERVE:
                break
            closer = self._closer()
            if closer is None or closer in (RETURN, CALL) or self.length + 1 >= self.max_len:
                if closer is not None:  # the mask allows only it: the sampler draws it, the engine's stops see it
                    self._buffer[:] = 0
                    self._buffer[closer // 32] = np.int32(np.uint32(1 << (closer % 32)).view(np.int32))
                    self._mask_at = -1  # not the grammar's: no gate holds it
                break
            if not self.matcher.consume_token(closer):
                raise RuntimeError(f"the grammar refused the closer it allowed: {self.matcher.get_error()}")
            self.length += 1
            self._track(closer)
            forced += [closer, *self._forced()]
        if self.matcher.is_stopped():
            self.phase = "done"
        return forced

    def _forced(self) -> list[int]:
        """The tokens the grammar forces here, up to a stop token, consumed."""
        m = self.matcher
        forced = m.compute_ff_tokens()
        forced = forced[: next((i for i, t in enumerate(forced) if t in (RETURN, CALL)), len(forced))]
        if forced and not m.consume_tokens(forced):
            raise RuntimeError(f"the grammar's forced tokens broke it: {m.get_error()}")
        self.length += len(forced)
        for t in forced:
            self._track(t)
        return forced

    def _track(self, t: int) -> None:
        """Follow JSON string boundaries through the answer's bytes (a new message starts outside any string)."""
        self.recent.append(t)
        if t >= FIRST_SPECIAL:
            self.in_string = self.escaped = False
            return
        for b in self.encoding.decode_single_token_bytes(t):
            if self.escaped:
                self.escaped = False
            elif self.in_string and b == 0x5C:  # backslash
                self.escaped = True
            elif b == 0x22:  # quote
                self.in_string = not self.in_string

    def _closer(self) -> int | None:
        """Near the length limit: the first of the closers the mask allows, if any. A free model can write a string
        or a number without end; this closes them (and the objects and arrays around them) instead."""
        return next((t for t in self.closers[self.in_string] if self.mask[t // 32] >> (t % 32) & 1), None)
