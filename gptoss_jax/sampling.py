"""Sampling parameters and the batched on-device sampler (per-row temperature, top-k, top-p, min-p,
seed, a structured-output token mask; the logits processors: penalties, logit bias, allowed tokens, bad words,
min_tokens) with optional log-probabilities. A new sampling field touches `SamplingParams`, `SamplingBatch` and the
sampler here, and the model runner's packing (`ModelRunner._sampling`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from gptoss_jax.structured import MAX_HELD, StructuredOutputsParams
from gptoss_jax.tokenizer import ASSISTANT_STOPS, ENDOFTEXT

EOS_TOKEN_IDS = (*ASSISTANT_STOPS, ENDOFTEXT)  # what `ignore_eos` lets through: <|return|>, <|call|>, <|endoftext|>

# Bounds every entry point enforces (`SamplingParams` offline, the server at its edge): what the engine's int32 and
# float32 sampling arrays hold, seeds as 64-bit integers (OpenAI's and vLLM's range), and stop lists small
# enough that matching them per token stays cheap.
INT32_MAX = 2**31 - 1
SEED_RANGE = (-(2**63), 2**64 - 1)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
FLOAT32_MAX = float(np.finfo(np.float32).max)
# The logits processors' per-request lists live on the device in fixed-shape arrays, one row per sequence slot
# (`SamplerState`): these are their capacities (OpenAI's logit_bias takes up to 300 entries).
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_ALLOWED_TOKEN_IDS = 1024
MAX_BAD_WORDS = 32  # token sequences, after tokenizing each word with and without a leading space
MAX_BAD_WORD_TOKENS = 8
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty and frequency_penalty (OpenAI's range)
COUNT_BITS = 15  # per slot and token: generated count (saturating at 2**15 - 1) | 1 << 15 where the prompt has it


@dataclasses.dataclass
class SamplingParams:
    """vLLM-style sampling settings. `temperature=0` is greedy; `top_k=0` / `top_p=1` / `min_p=0`
    disable those filters; `seed=None` draws from the engine's generator. `stop` strings end the
    output (the text excludes them; needs a tokenizer); `logprobs=n` returns each new token's
    log-probability and the `n` most likely alternatives (0 = the sampled token's only). `n` completions per prompt
    (`LLM.generate`; with a `seed`, completion `i` uses `seed + i`, as the server does).
    `structured_outputs` constrains the answer (`structured.StructuredOutputsParams`, vLLM's; needs a tokenizer);
    `thinking_token_budget` caps the reasoning (the analysis message's tokens) before the answer is forced open:
    default, with structured outputs, half of `max_tokens`."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] | list[int] = ASSISTANT_STOPS
    stop: tuple[str, ...] | list[str] | str | None = None
    logprobs: int | None = None
    n: int = 1
    # Structured outputs (gptoss_jax/structured.py).
    structured_outputs: StructuredOutputsParams | None = None
    thinking_token_budget: int | None = None
    # Logits processors (vLLM semantics; `apply_penalties_and_bias` on device). presence/frequency: over the tokens
    # generated so far; repetition: over prompt and generated tokens (positive logits divided, negative ones
    # multiplied); logit_bias: token id -> added to its logit; min_tokens: stop tokens (and stop strings) held off
    # until that many tokens; ignore_eos: the end-of-sequence tokens (`EOS_TOKEN_IDS`) do not end the output;
    # bad_words: strings never generated (tokenized by the engine); allowed_token_ids: only these are sampled;
    # best_of: `LLM.generate` samples this many and returns the `n` of highest cumulative log-probability.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    bad_words: tuple[str, ...] | list[str] | None = None
    allowed_token_ids: tuple[int, ...] | list[int] | None = None
    best_of: int | None = None

    def __post_init__(self):
        def bad(field, why):
            raise ValueError(f"SamplingParams.{field}={_short(getattr(self, field))}: {why}")

        def is_int(x):
            return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))

        def is_num(x):
            return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))

        if not is_num(self.temperature) or not 0 <= self.temperature <= FLOAT32_MAX:
            bad("temperature", "must be a finite number >= 0")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or not 0 <= self.top_k <= INT32_MAX:
            bad(
                "top_k", f"must be an integer in [0, {INT32_MAX}] (0 disables it; the engine caps it at its vocabulary)"
            )
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not is_int(self.seed) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            bad("seed", f"must be None or an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]")
        if not is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT32_MAX:
            bad("max_tokens", f"must be an integer in [1, {INT32_MAX}]")
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__len__"):
            bad("stop_token_ids", "must be a list of token ids")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} are supported")
        if any(not is_int(t) or not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or ()
        if not isinstance(stop, (list, tuple)) or any(not isinstance(x, str) or not x for x in stop):
            bad("stop", "must be a string or a list of non-empty strings")
        if len(stop) > MAX_STOP_STRINGS or any(len(x) > MAX_STOP_CHARS for x in stop):
            bad("stop", f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters each")
        self.stop = tuple(stop)
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= INT32_MAX):
            bad("logprobs", "must be an integer >= 0 or None")
        if not is_int(self.n) or not 1 <= self.n <= INT32_MAX:
            bad("n", "must be an integer >= 1")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "must be a StructuredOutputsParams (or a dict of its fields) or None")
        if self.thinking_token_budget is not None and (
            not is_int(self.thinking_token_budget) or not 0 <= self.thinking_token_budget <= INT32_MAX
        ):
            bad("thinking_token_budget", "must be None or an integer >= 0")
        self.temperature, self.top_p, self.min_p = float(self.temperature), float(self.top_p), float(self.min_p)
        self.top_k, self.max_tokens, self.n = int(self.top_k), int(self.max_tokens), int(self.n)
        self.seed = None if self.seed is None else int(self.seed)
        self.logprobs = None if self.logprobs is None else int(self.logprobs)
        self._check_processors(bad, is_int, is_num)

    def _check_processors(self, bad, is_int, is_num) -> None:
        lo, hi = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_num(getattr(self, name)) or not lo <= getattr(self, name) <= hi:
                bad(name, f"must be in [{lo:g}, {hi:g}]")
            setattr(self, name, float(getattr(self, name)))
        if not is_num(self.repetition_penalty) or not 0 < self.repetition_penalty <= FLOAT32_MAX:
            bad("repetition_penalty", "must be a finite number > 0 (1 disables it)")
        self.repetition_penalty = float(self.repetition_penalty)
        if self.logit_bias is not None:
            blo, bhi = LOGIT_BIAS_RANGE
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", "must be a dict of token id -> bias")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                bad("logit_bias", f"at most {MAX_LOGIT_BIAS} entries are supported")
            for k, v in self.logit_bias.items():
                if not is_int(k) or not 0 <= k <= INT32_MAX:
                    bad("logit_bias", f"key {k!r} is not a token id")
                if not is_num(v) or not blo <= v <= bhi:
                    bad("logit_bias", f"the bias of token {k} must be a number in [{blo:g}, {bhi:g}]")
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}]")
        self.min_tokens = int(self.min_tokens)
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            bad("ignore_eos", "must be a bool")
        self.ignore_eos = bool(self.ignore_eos)
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, (list, tuple)) or any(not isinstance(w, str) or not w.strip() for w in words):
                bad("bad_words", "must be a list of non-empty strings")
            if len(words) > MAX_BAD_WORDS:
                bad("bad_words", f"at most {MAX_BAD_WORDS} are supported")
            self.bad_words = tuple(words)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__") or not len(ids):
                bad("allowed_token_ids", "must be a non-empty list of token ids")
            if len(ids) > MAX_ALLOWED_TOKEN_IDS:
                bad("allowed_token_ids", f"at most {MAX_ALLOWED_TOKEN_IDS} are supported")
            if any(not is_int(t) or not 0 <= t <= INT32_MAX for t in ids):
                bad("allowed_token_ids", "must be non-negative integers")
            self.allowed_token_ids = tuple(int(t) for t in ids)
        if self.best_of is not None and (not is_int(self.best_of) or not self.n <= self.best_of <= INT32_MAX):
            bad("best_of", f"must be None or an integer >= n={self.n}")
        self.best_of = None if self.best_of is None else int(self.best_of)

    @property
    def uses_processors(self) -> bool:
        """Whether any logits processor is on (the sampler's per-row flags say which)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.logit_bias
            or self.min_tokens
            or self.bad_words
            or self.allowed_token_ids
        )

    @property
    def needs_history(self) -> bool:
        """Whether the sampler reads this request's earlier tokens on the device (penalties, bad words): they are
        rebuilt from its prefill, so it computes its whole prompt rather than reuse the prefix cache."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1 or self.bad_words)


def _short(value, limit: int = 200) -> str:
    """`repr` cut to `limit` characters: error messages stay readable whatever a caller passed."""
    r = repr(value)
    return r if len(r) <= limit else f"{r[:limit]}... ({len(r)} characters)"


@struct.dataclass
class SamplingBatch:
    """Every row's `SamplingParams` as the on-device sampler reads them (packed by the model runner)."""

    temperature_B: jax.Array  # f32
    top_k_B: jax.Array  # i32
    top_p_B: jax.Array  # f32
    min_p_B: jax.Array  # f32
    keys_B2: jax.Array  # u32 [B, 2] raw PRNG key data
    want_logprobs_B: jax.Array  # bool
    masked_B: jax.Array  # bool: the row draws under `mask_BW` (structured outputs), as `mask_applies` says
    mask_BW: jax.Array  # i32 [B, ceil(V / 32)] packed allowed-token bits (`structured.mask_words`)
    mask_pos_B: jax.Array  # i32: the position of the token the mask is for
    holds_B: jax.Array  # bool: the mask also holds after it across `SamplerState.stay_W` tokens (`structured.Gate`)
    # The logits processors (`apply_penalties_and_bias`): presence, frequency, repetition penalty; and the flags
    # (`USES_*`), min_tokens, prompt length and sequence slot (its row of `SamplerState`).
    penalties_B3: jax.Array  # f32 [B, 3]
    proc_B4: jax.Array  # i32 [B, 4]


# `SamplingBatch.proc_B4[:, 0]`: which processors a row uses.
USES_PENALTIES, USES_BIAS, USES_ALLOWED, USES_BAD_WORDS, USES_MIN_TOKENS = 1, 2, 4, 8, 16


@struct.dataclass
class SamplingLists:
    """A prefill call's per-row processor lists, written to each row's slot of `SamplerState` (padding: id V, which
    scatters nowhere; bad words right-aligned, -1 before their first token)."""

    bias_ids_BN: jax.Array  # i32 [B, MAX_LOGIT_BIAS]
    bias_BN: jax.Array  # f32 [B, MAX_LOGIT_BIAS]
    allowed_BA: jax.Array  # i32 [B, MAX_ALLOWED_TOKEN_IDS]
    bad_BWL: jax.Array  # i32 [B, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS]
    stops_BK: jax.Array  # i32 [B, MAX_STOP_TOKEN_IDS]: the tokens min_tokens holds off


@struct.dataclass
class SamplerState:
    """What the logits processors keep on the device per sequence slot, across calls (donated to the steps), so
    that they see the tokens sampled earlier in the same call and in calls the host has not read yet:
    `counts_SV` (uint16) the generated tokens' counts in the low `COUNT_BITS` bits, saturating, and the prompt's
    tokens in the top bit; `recent_SR` the token at each position p in column p % MAX_BAD_WORD_TOKENS (bad words
    match the last tokens; a held structured-output mask checks the tokens since its position); and the slot's
    `SamplingLists` rows. Counts and recent tokens are rebuilt by each sequence's prefill from position 0
    (`SamplingParams.needs_history`), so preemption loses nothing. `stay_W` is not per slot: the packed tokens a held
    mask holds across (`structured.stay_tokens`; none until a structured-output request sets them)."""

    counts_SV: jax.Array
    recent_SR: jax.Array
    lists: SamplingLists
    stay_W: jax.Array

    @staticmethod
    def zeros(num_slots: int, vocab_size: int) -> SamplerState:
        B = num_slots
        return SamplerState(
            jnp.zeros((B, vocab_size), jnp.uint16),
            jnp.zeros((B, MAX_BAD_WORD_TOKENS), jnp.int32),
            empty_lists(B, vocab_size, jnp),
            jnp.zeros((-(-vocab_size // 32),), jnp.int32),
        )


def empty_lists(rows: int, vocab_size: int, xp=np) -> SamplingLists:
    """Lists that do nothing (host arrays with `xp=np`)."""
    return SamplingLists(
        xp.full((rows, MAX_LOGIT_BIAS), vocab_size, xp.int32),
        xp.zeros((rows, MAX_LOGIT_BIAS), xp.float32),
        xp.full((rows, MAX_ALLOWED_TOKEN_IDS), vocab_size, xp.int32),
        xp.full((rows, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), -1, xp.int32),
        xp.full((rows, MAX_STOP_TOKEN_IDS), vocab_size, xp.int32),
    )


@struct.dataclass
class Sampled:
    tokens: jax.Array  # i32 [..., B]
    logprob: jax.Array  # f32 [..., B] of the sampled token
    top_ids: jax.Array  # i32 [..., B, num_top]
    top_lps: jax.Array  # f32 [..., B, num_top]


def shortcut(pred: jax.Array, on_true, on_false, branchless: bool = False):
    """`lax.cond(pred, on_true, on_false)`: work that batches without a row needing it skip. `branchless` computes
    both and selects instead: XLA runs a GPU conditional by reading its predicate on the host, which waits for the
    device there, so a prefill call's sampler would hold the host for the call's whole forward pass (BENCHMARKS
    §12b); the sampler's passes cost little next to a prefill, and much next to a decode step."""
    if not branchless:
        return jax.lax.cond(pred, on_true, on_false)
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true(), on_false())


def sample_batch(
    logits_BV: jax.Array,
    pos_B: jax.Array,
    sb: SamplingBatch,
    num_top: int,
    state: SamplerState | None = None,
    branchless: bool = False,
    plain: bool = False,
) -> Sampled:
    """The tokens after positions `pos_B`: each row's key folded with the position it predicts from (so a
    request's draws depend neither on its batch neighbours, nor on chunking, nor on preemption), `sample` of the
    logits after the processors (`apply_penalties_and_bias`, skipped by batches where no row uses one), and the
    log-probabilities of the model's own distribution (before the processors, as vLLM's default) when any row asks
    for them. `branchless`: no conditional skips work (`shortcut`). `plain` (static): every row is greedy, without
    processors, a mask or log-probabilities (the caller knows), so the argmax is all there is: no conditional."""
    if plain:
        return Sampled(_max_argmax(logits_BV.astype(jnp.float32))[1], *no_logprobs(logits_BV.shape[0], num_top))
    keys = jax.vmap(jax.random.fold_in)(sb.keys_B2, pos_B)

    def draw(logits):
        # Batches without a structured-output row skip the mask's pass over `[B, V]`.
        logits = shortcut(
            jnp.any(sb.masked_B), lambda: apply_mask(logits, sb.masked_B, sb.mask_BW), lambda: logits, branchless
        )
        return sample(logits, keys, sb.temperature_B, sb.top_k_B, sb.top_p_B, sb.min_p_B, branchless)

    if state is None:
        tokens = draw(logits_BV)
    else:  # both branches sample, so no [B, V] array passes through the condition
        tokens = shortcut(
            jnp.any(sb.proc_B4[:, 0] != 0),
            lambda: draw(apply_penalties_and_bias(logits_BV, pos_B, sb, state, branchless)),
            lambda: draw(logits_BV),
            branchless,
        )
    empty = lambda: no_logprobs(tokens.shape[0], num_top)  # noqa: E731
    lp = shortcut(jnp.any(sb.want_logprobs_B), lambda: logprobs(logits_BV, tokens, num_top), empty, branchless)
    return Sampled(tokens, *lp)


def no_logprobs(n: int, num_top: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`logprobs`' outputs for `n` tokens when no row asks for them: zeros."""
    return jnp.zeros(n, jnp.float32), jnp.zeros((n, num_top), jnp.int32), jnp.zeros((n, num_top), jnp.float32)


def mask_applies(sb: SamplingBatch, state: SamplerState, pos_B: jax.Array) -> jax.Array:
    """Whether each row draws the token after `pos_B` under its structured-output mask (`structured.Gate.applies`
    decides the same on the host): at the mask's position; after it, where the row's mask `holds_B`, while every
    token from that position to `pos_B` (read back from `recent_SR`, where this step's input is already recorded;
    at most `MAX_HELD` of them) is allowed by the mask and one of `stay_W`."""
    R = state.recent_SR.shape[1]
    assert R >= MAX_HELD, (R, MAX_HELD)
    since_B = pos_B + 1 - sb.mask_pos_B  # tokens between the mask's position and the one drawn now
    j_R = jnp.arange(MAX_HELD)
    tok_BR = state.recent_SR[sb.proc_B4[:, 3:4], (sb.mask_pos_B[:, None] + j_R) % R]
    allowed = jnp.take_along_axis(sb.mask_BW, tok_BR // 32, axis=1) & state.stay_W[tok_BR // 32]
    stays_BR = ((allowed >> (tok_BR % 32)) & 1) != 0
    held_B = jnp.all(stays_BR | (j_R >= since_B[:, None]), axis=1) & sb.holds_B & (since_B <= MAX_HELD)
    return sb.masked_B & (pos_B >= 0) & ((since_B == 0) | ((since_B > 0) & held_B))


def apply_mask(logits_BV: jax.Array, masked_B: jax.Array, mask_BW: jax.Array) -> jax.Array:
    """-inf where a masked row's bit is clear: token t is allowed by bit `t % 32` of word `t // 32`."""
    with jax.named_scope("token_mask"):
        B, V = logits_BV.shape
        bits = (mask_BW[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
        allowed = bits.reshape(B, -1)[:, :V] != 0
        return jnp.where(masked_B[:, None] & ~allowed, jnp.asarray(-jnp.inf, logits_BV.dtype), logits_BV)


def apply_penalties_and_bias(
    logits_BV: jax.Array, pos_B: jax.Array, sb: SamplingBatch, st: SamplerState, branchless: bool = False
):
    """The logits processors, per row as its flags say, in vLLM's order: allowed_token_ids, bad words, min_tokens
    (the row's stop tokens banned while fewer than min_tokens tokens follow the prompt), logit_bias, then the
    repetition, frequency and presence penalties over the slot's counts. The row after position `pos_B` is being
    sampled: tokens at positions >= the prompt length are generated ones. Each processor is skipped by batches
    where no row uses it."""
    logits = logits_BV.astype(jnp.float32)
    B, V = logits.shape
    flags, min_tokens, prompt_len, slot = (sb.proc_B4[:, i] for i in range(4))
    rows = jnp.arange(B)[:, None]
    generated = jnp.maximum(pos_B + 1 - prompt_len, 0)  # tokens after the prompt so far

    def uses(bit):
        return (flags & bit) != 0

    def when(bit, fn):
        nonlocal logits
        logits = shortcut(jnp.any(uses(bit)), lambda: fn(logits), lambda: logits, branchless)

    def allowed(x):
        ids = st.lists.allowed_BA[slot]
        mask = jnp.zeros((B, V), bool).at[rows, ids].set(True, mode="drop")
        return jnp.where(uses(USES_ALLOWED)[:, None] & ~mask, -jnp.inf, x)

    def bad_words(x):
        words = st.lists.bad_BWL[slot]  # [B, W, L], right-aligned
        L = words.shape[-1]
        back = jnp.arange(L - 2, -1, -1)  # column j of a word must match the token at position pos - (L - 2 - j)
        at = pos_B[:, None] - back[None, :]  # [B, L - 1]
        recent = st.recent_SR[slot[:, None], at % L]
        valid = at >= prompt_len[:, None]  # bad words match generated tokens only
        prefix = words[:, :, :-1]
        match = (prefix < 0) | (valid[:, None, :] & (recent[:, None, :] == prefix))
        last = words[:, :, -1]
        banned = jnp.all(match, axis=-1) & (last >= 0) & uses(USES_BAD_WORDS)[:, None]
        return x.at[rows, jnp.where(banned, last, V)].set(-jnp.inf, mode="drop")

    def min_tokens_(x):
        early = uses(USES_MIN_TOKENS) & (generated < min_tokens)
        ids = jnp.where(early[:, None], st.lists.stops_BK[slot], V)
        return x.at[rows, ids].set(-jnp.inf, mode="drop")

    def bias(x):
        on = uses(USES_BIAS)[:, None]
        return x.at[rows, st.lists.bias_ids_BN[slot]].add(jnp.where(on, st.lists.bias_BN[slot], 0.0), mode="drop")

    def penalties(x):
        counts = st.counts_SV[slot]
        n = (counts & ((1 << COUNT_BITS) - 1)).astype(jnp.float32)
        seen = (n > 0) | (counts >> COUNT_BITS != 0)
        on = uses(USES_PENALTIES)[:, None]
        presence, frequency, repetition = (sb.penalties_B3[:, i : i + 1] for i in range(3))
        x = jnp.where(on & seen, jnp.where(x > 0, x / repetition, x * repetition), x)
        return x - jnp.where(on, frequency * n + presence * (n > 0), 0.0)

    with jax.named_scope("logits_processors"):
        when(USES_ALLOWED, allowed)
        when(USES_BAD_WORDS, bad_words)
        when(USES_MIN_TOKENS, min_tokens_)
        when(USES_BIAS, bias)
        when(USES_PENALTIES, penalties)
    return logits


def record_prefill(st: SamplerState, sb: SamplingBatch, lists: SamplingLists, tokens_BT, positions_BT, last_B):
    """A prefill chunk into its rows' slots: their lists; for rows with penalties, the counts (reset by a chunk
    that starts at position 0, then the chunk's prompt tokens flagged and its generated tokens counted: a
    preempted sequence recomputes them); the chunk's last tokens into `recent_SR`. Padding rows go nowhere."""
    flags, _, prompt_len, slot = (sb.proc_B4[:, i] for i in range(4))
    S, V = st.counts_SV.shape
    B, T = tokens_BT.shape
    real = positions_BT[:, 0] >= 0
    slot = jnp.where(real, slot, S)  # out of range: dropped
    lists = jax.tree.map(lambda t, new: t.at[slot].set(new, mode="drop"), st.lists, lists)
    pen = real & ((flags & USES_PENALTIES) != 0)
    reset = jnp.where(pen & (positions_BT[:, 0] == 0), slot, S)
    counts = st.counts_SV.at[reset].set(jnp.uint16(0), mode="drop")
    valid = pen[:, None] & (positions_BT >= 0)
    s_BT = jnp.broadcast_to(slot[:, None], (B, T))
    gen = valid & (positions_BT >= prompt_len[:, None])
    cap = (1 << COUNT_BITS) - 1 - T  # a chunk adds at most T: the count never reaches the prompt bit
    old = counts[s_BT, tokens_BT] & ((1 << COUNT_BITS) - 1)
    counts = counts.at[jnp.where(gen, s_BT, S), tokens_BT].add((old < cap).astype(jnp.uint16), mode="drop")
    prompt = valid & (positions_BT < prompt_len[:, None])
    flagged = counts[s_BT, tokens_BT] | jnp.uint16(1 << COUNT_BITS)
    counts = counts.at[jnp.where(prompt, s_BT, S), tokens_BT].set(flagged, mode="drop")
    R = st.recent_SR.shape[1]
    back = last_B[:, None] - jnp.arange(R)[None, :]  # the chunk's last R columns: distinct positions mod R
    pos = jnp.take_along_axis(positions_BT, jnp.maximum(back, 0), axis=1)
    tok = jnp.take_along_axis(tokens_BT, jnp.maximum(back, 0), axis=1)
    keep = (back >= 0) & (pos >= 0)
    recent = st.recent_SR.at[jnp.where(keep, slot[:, None], S), pos % R].set(tok, mode="drop")
    return st.replace(counts_SV=counts, recent_SR=recent, lists=lists)


def record_input(st: SamplerState, sb: SamplingBatch, tokens_B, pos_B) -> SamplerState:
    """A decode step's input tokens (the last sampled ones) into their slots: counted where they are generated
    tokens of a row with penalties, and into `recent_SR`."""
    flags, _, prompt_len, slot = (sb.proc_B4[:, i] for i in range(4))
    S = st.counts_SV.shape[0]
    R = st.recent_SR.shape[1]
    real = pos_B >= 0
    count = jnp.where(real & ((flags & USES_PENALTIES) != 0) & (pos_B >= prompt_len), slot, S)
    old = st.counts_SV.at[count, tokens_B].get(mode="fill", fill_value=0)
    bump = (old & ((1 << COUNT_BITS) - 1)) < (1 << COUNT_BITS) - 1
    counts = st.counts_SV.at[count, tokens_B].set(old + bump.astype(jnp.uint16), mode="drop")
    recent = st.recent_SR.at[jnp.where(real, slot, S), jnp.maximum(pos_B, 0) % R].set(tokens_B, mode="drop")
    return st.replace(counts_SV=counts, recent_SR=recent)


def sample(
    logits_BV: jax.Array,
    keys_B: jax.Array,
    temperature_B: jax.Array,
    top_k_B: jax.Array,
    top_p_B: jax.Array,
    min_p_B: jax.Array,
    branchless: bool = False,
) -> jax.Array:
    """One token per row. Rows with temperature 0 take the argmax; others sample after the filters.

    Each row has its own PRNG key, so a request's draws do not depend on its batch neighbours.
    With temperature only (no filter in the batch) this is two passes over `[B, V]` and stores no
    `[B, V]` array: the maximum with the argmax, then the block sums of the draw.
    """
    logits = logits_BV.astype(jnp.float32)
    max_B, greedy = _max_argmax(logits)
    # The filters below cost passes over the vocabulary; all-greedy batches skip them.
    return shortcut(
        jnp.any(temperature_B > 0),
        lambda: _filtered_draw(logits, max_B, greedy, keys_B, temperature_B, top_k_B, top_p_B, min_p_B, branchless),
        lambda: greedy,
        branchless,
    )


def _max_argmax(x_BV: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row, the maximum and its first index (as `jnp.argmax`, NaNs aside) from one variadic
    reduction: one pass over `[B, V]` where `jnp.max` and `jnp.argmax` take two."""

    def larger(a, b):
        (a_val, a_id), (b_val, b_id) = a, b
        pick_a = (a_val > b_val) | ((a_val == b_val) & (a_id < b_id))
        return jnp.where(pick_a, a_val, b_val), jnp.where(pick_a, a_id, b_id)

    ids_BV = jax.lax.broadcasted_iota(jnp.int32, x_BV.shape, 1)
    return jax.lax.reduce((x_BV, ids_BV), (np.float32(-np.inf), np.int32(0)), larger, (1,))


# Every filter keeps a prefix of the tokens sorted by logit, so each is a threshold on the logit. The
# top-k and top-p thresholds are found by a radix select on the bits of the logits (`_rank_threshold`):
# a fixed number of compare-and-reduce passes over `[B, V]`, exact for any k and any nucleus width,
# with no sort and no `lax.top_k` (the 1,024-candidate `lax.top_k` this replaces cost as much as a
# full sort of the vocabulary: 3.8 ms at batch 256 on an H200). Batches without a top-k or top-p row
# skip the search (min-p needs only the maximum).
DRAW_BLOCK = 1024  # the inverse-CDF draw finds a block of this many tokens, then the token inside it
# Bits of a threshold decided per pass: 32 / RADIX_BITS passes over `[B, V]`, each comparing every token
# with 2**RADIX_BITS - 1 candidates. 2 (16 passes x 3 compares) is an estimate of where the reads and the
# compares balance on a GPU (at 4 bits, 8 x 15, the compares should dominate); on a CPU, which is
# compute-bound, 1 bit is fastest. `tools/bench_sampling.py` times 1, 2 and 4 bits.
RADIX_BITS = 2


def _filtered_draw(logits, max_B, greedy, keys_B, temperature_B, top_k_B, top_p_B, min_p_B, branchless):
    """The filtered draw of the rows with temperature > 0. The scaled logits and the weights are
    recomputed where they are read (the block-sum reduction, the chosen block, the drawn token) rather
    than stored: each `[B, V]` array written would cost a pass of its own."""
    temp_B, top0, threshold = _threshold(logits, max_B, temperature_B, top_k_B, top_p_B, min_p_B, branchless)

    def weight(logits_BX):  # unnormalised probabilities of the tokens the filters keep, 0 elsewhere
        scaled = logits_BX / temp_B[:, None]
        return jnp.where(scaled >= threshold[:, None], jnp.exp(scaled - top0[:, None]), 0.0)

    drawn = _inverse_cdf(logits, weight, jax.vmap(lambda key: jax.random.uniform(key))(keys_B))
    kept = weight(jnp.take_along_axis(logits, drawn[:, None], axis=-1))[:, 0] > 0
    drawn = jnp.where(kept, drawn, greedy)  # u landed on a zero-width edge
    return jnp.where(temperature_B > 0, drawn, greedy).astype(jnp.int32)


def _threshold(logits, max_B, temperature_B, top_k_B, top_p_B, min_p_B, branchless=False):
    """(clamped temperature, top scaled logit, threshold): the filters keep the tokens whose scaled logit is at
    least the threshold."""
    B, V = logits.shape
    temp_B = jnp.maximum(temperature_B, 1e-6)
    top0 = max_B / temp_B
    ranked = (temperature_B > 0) & (((top_k_B > 0) & (top_k_B < V)) | (top_p_B < 1))
    t = shortcut(
        jnp.any(ranked),
        lambda: _rank_threshold(logits / temp_B[:, None], top_k_B, top_p_B, branchless),
        lambda: jnp.full((B,), -jnp.inf, jnp.float32),
        branchless,
    )
    t_min_p = jnp.where(min_p_B > 0, top0 + jnp.log(jnp.maximum(min_p_B, 1e-30)), -jnp.inf)
    return temp_B, top0, jnp.minimum(jnp.maximum(t, t_min_p), top0)  # the most likely token always survives


def filtered_probs(logits_BV, temperature_B, top_k_B, top_p_B, min_p_B) -> jax.Array:
    """The distribution `sample` draws from at temperature > 0, `[B, V]` (f32): softmax of the tempered logits over
    the tokens top-k, top-p and min-p keep (speculative decoding tests drafts against it)."""
    logits = logits_BV.astype(jnp.float32)
    temp_B, top0, threshold = _threshold(logits, jnp.max(logits, axis=-1), temperature_B, top_k_B, top_p_B, min_p_B)
    scaled = logits / temp_B[:, None]
    w = jnp.where(scaled >= threshold[:, None], jnp.exp(scaled - top0[:, None]), 0.0)
    return w / jnp.sum(w, axis=-1, keepdims=True)


def _rank_threshold(scaled, top_k_B, top_p_B, branchless=False):
    """Per row, a threshold on the scaled logits such that the top-k and top-p filters keep exactly
    the tokens with `scaled >= threshold`: the smallest scaled logit they keep, or -inf where they keep
    every token (neither filter active, or a nucleus that is the whole row).

    With the row sorted descending (`s`) and `p` its softmax probabilities, the definitions are
      top-k: `s[k - 1]`, ties included (every token equal to the k-th largest is kept);
      top-p: `s[kept - 1]`, where `kept` counts the positions whose exclusive cumulative sum of `p` is
             below `top_p` (so at least 1).
    Both are "the largest value t with F(t) >= target", where F(t) sums a weight over the tokens with
    `scaled >= t`: weight 1 and target k for top-k; weight p and target top_p for top-p. (For top-p:
    the mass at or above `s[kept - 1]` includes position kept, so it is at least top_p; the mass at or
    above any larger value is at most the exclusive sum at position kept - 1 < top_p.) F only falls
    as t rises, so the largest such t is found a few bits at a time, most significant first, on
    order-preserving uint32 keys of the values (`_radix_select`): each pass sums, for each value the
    next bits could take, the weight at or above it, and keeps the largest that still reaches the
    target. The same number of passes for each active filter whatever k or the nucleus width.

    The top-p mass is summed in f32 in a different order than a cumulative sum of the sorted row, so
    where the mass at or above a value lies within rounding of top_p the two can disagree by that value's
    tokens; both are then equally right.
    """
    B, V = scaled.shape
    keys = _order_keys(scaled)
    k = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, V), V)
    active_k = (top_k_B > 0) & (top_k_B < V)
    active_p = top_p_B < 1
    off = jnp.full((B,), -jnp.inf, scaled.dtype)

    def top_k_threshold():
        return jnp.where(active_k, _from_order_keys(_radix_select(keys, None, k)), -jnp.inf)

    def top_p_threshold():
        p = jnp.exp(scaled - jax.nn.logsumexp(scaled, axis=-1, keepdims=True))
        key = _radix_select(keys, p, top_p_B.astype(p.dtype))
        # Key 0 (a NaN, never a token's key) is left when even the whole row's summed mass falls short
        # of top_p: every token is kept.
        return jnp.where(active_p & (key > 0), _from_order_keys(key), -jnp.inf)

    # Each search is skipped by batches in which no row uses its filter.
    t_k = shortcut(jnp.any(active_k), top_k_threshold, lambda: off, branchless)
    t_p = shortcut(jnp.any(active_p), top_p_threshold, lambda: off, branchless)
    return jnp.maximum(t_k, t_p)


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys with the order of the f32 values `x` (-inf lowest; no NaNs): negative values get all
    their bits flipped, non-negative ones the sign bit set. -0.0 gets the key just below +0.0's, which
    changes no threshold: either one, as a float, keeps both through `>=`."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where((bits >> 31) == 1, ~bits, bits | jnp.uint32(0x80000000))


def _from_order_keys(key: jax.Array) -> jax.Array:
    """The f32 values of `_order_keys` keys."""
    bits = jnp.where((key >> 31) == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _radix_select(
    keys_BV: jax.Array, weights_BV: jax.Array | None, target_B: jax.Array, bits: int = RADIX_BITS
) -> jax.Array:
    """Per row, the largest key T such that the weight of the keys >= T (their count when `weights_BV`
    is None) reaches `target_B`: one of the row's keys, or 0 if even the whole row falls short.

    A static loop of 32 / `bits` passes, each a single compare-and-sum over `[B, V]` against the
    2**bits - 1 candidates that XLA fuses (no sort, scatter or histogram)."""
    assert 32 % bits == 0, bits
    B, _ = keys_BV.shape
    digits = jnp.arange(1, 1 << bits, dtype=jnp.uint32)  # [D]; digit 0 keeps the prefix as it is
    prefix = jnp.zeros((B,), jnp.uint32)
    for shift in range(32 - bits, -1, -bits):
        candidates = prefix[:, None] | (digits[None, :] << shift)  # [B, D], ascending
        at_or_above = keys_BV[:, None, :] >= candidates[:, :, None]  # [B, D, V]
        if weights_BV is None:
            reach = jnp.sum(at_or_above, axis=-1, dtype=jnp.int32)
        else:
            reach = jnp.sum(jnp.where(at_or_above, weights_BV[:, None, :], 0), axis=-1)
        # The weight falls as the candidate rises, so the candidates that reach the target are a prefix.
        digit = jnp.sum(reach >= target_B[:, None], axis=-1, dtype=jnp.uint32)
        prefix = prefix | (digit << shift)
    return prefix


def _inverse_cdf(logits_BV: jax.Array, weight, u_B: jax.Array) -> jax.Array:
    """The token where the cumulative `weight(logits)` first exceeds `u * total`, per row. Two levels
    (block sums, then a cumulative sum inside one block) instead of a cumulative sum over the vocabulary,
    which XLA runs as many passes over `[B, V]`. `weight` is elementwise: it runs inside the block-sum
    reduction and again on the chosen block's gathered logits, so the weights are never stored."""
    B, V = logits_BV.shape
    nb = -(-V // DRAW_BLOCK)
    w = jnp.pad(weight(logits_BV), ((0, 0), (0, nb * DRAW_BLOCK - V))).reshape(B, nb, DRAW_BLOCK)
    cum_blocks = jnp.cumsum(jnp.sum(w, axis=-1), axis=-1)  # [B, nb]
    u = u_B * cum_blocks[:, -1]
    j = jnp.minimum(jnp.sum(cum_blocks <= u[:, None], axis=-1), nb - 1)
    before = jnp.where(j > 0, jnp.take_along_axis(cum_blocks, jnp.maximum(j - 1, 0)[:, None], -1)[:, 0], 0.0)
    ids = j[:, None] * DRAW_BLOCK + jnp.arange(DRAW_BLOCK)  # [B, DRAW_BLOCK]
    # The last block runs past V: -inf there has weight 0, as the padding has.
    block = jnp.take_along_axis(logits_BV, ids, axis=-1, mode="fill", fill_value=-jnp.inf)
    inner = jnp.cumsum(weight(block), axis=-1)  # [B, DRAW_BLOCK]
    i = jnp.minimum(jnp.sum(inner <= (u - before)[:, None], axis=-1), DRAW_BLOCK - 1)
    return jnp.minimum(j * DRAW_BLOCK + i, V - 1)


def logprobs(logits_BV: jax.Array, tokens_B: jax.Array, num_top: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probabilities of the model's own distribution (before temperature and filters): of the
    sampled tokens `[B]`, and the `num_top` most likely ids and values `[B, num_top]`."""
    lp = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens_B[:, None], axis=-1)[:, 0]
    top_vals, top_ids = top_k(lp, num_top)
    return chosen, top_ids, top_vals


def top_k(x_BV: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k` (values descending, ties to the lower id) as `k` argmax passes over `[B, V]`, each
    finding the next (value, id) after the last one found.

    Why not `lax.top_k`: the engine's steps call this under a `lax.cond` (only batches that ask for
    log-probabilities pay for it), and with `lax.top_k` over the vocabulary in that branch every engine
    call returned only when its device work had ended, so nothing overlapped the host's work for the
    next step; with these passes calls return at once (docs/BENCHMARKS.md §4d; the mechanism inside XLA
    was not pinned down). They are also about twice as fast as `lax.top_k` at batch 64-256."""
    B, V = x_BV.shape
    keys = _order_keys(x_BV)  # every key > 0 (no NaNs): 0 marks a taken entry
    ids = jnp.arange(V, dtype=jnp.int32)
    last_key, last_id = jnp.full((B, 1), 0xFFFFFFFF, jnp.uint32), jnp.full((B, 1), -1, jnp.int32)
    found = []
    for _ in range(k):
        after = (keys < last_key) | ((keys == last_key) & (ids > last_id))
        i = jnp.argmax(jnp.where(after, keys, jnp.uint32(0)), axis=-1).astype(jnp.int32)[:, None]
        last_key, last_id = jnp.take_along_axis(keys, i, axis=-1), i
        found.append(i)
    top_ids = jnp.concatenate(found, axis=-1)
    return jnp.take_along_axis(x_BV, top_ids, axis=-1), top_ids


def find_stop_string(text: str, stops: tuple[str, ...], start: int = 0) -> tuple[int, str] | None:
    """Earliest stop string in `text` ending at or after `start`: `(index where it begins, stop)`."""
    best = None
    for stop in stops:
        i = text.find(stop, max(0, start - len(stop) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    return best
