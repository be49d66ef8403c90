"""Speculative decoding: the `speculative_config` (vLLM's names), the drafters that propose tokens on the device, and
the on-device verification that accepts them (`verify`), which `steps.decode_speculative` runs inside the multi-step
decode loop.

Each decode iteration gives every drafting row its last token and k draft tokens at consecutive positions, runs them
through the target in one forward over the paged cache, and accepts a prefix of the drafts: greedy rows while each
draft equals the target's argmax, sampled rows by exact speculative rejection sampling, so the output is the target's
(token for token when greedy, in distribution when sampled). The row then continues from the target's own token after
the accepted drafts; the K/V its rejected drafts left behind sit at positions past the row's length, which attention
never reads (it masks by position) and the next iteration overwrites. docs/engine.md has the design.

A drafter is a frozen (hashable, static) object with `num_tokens` (k), `history_tokens` (columns of the per-slot
`DraftState` it reads), `propose(params, state, inputs) -> Draft`, traced into the decode step, and optionally
`params(spec, target_params)`: its device arrays (weights), passed to the step beside the target's (None without the
method). A drafter model that reads the target's hidden states (`Eagle3Drafter`) also has `aux_layers`: the target
steps then return those layers' states, and its `after_prefill` / `after_verify` draft from them on device.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from gptoss_jax import eagle3, sampling
from gptoss_jax.checkpoint import CheckpointError, resolve_model
from gptoss_jax.config import ConfigError, ModelConfig

METHODS = ("ngram", "eagle3", "oracle", "random")
MAX_SPECULATIVE_TOKENS = 16
# Salts folded into a row's position key: the drafter's own draws, the acceptance test, the resampling.
DRAFT_SALT, ACCEPT_SALT, RESAMPLE_SALT = 1, 2, 3


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """`speculative_config` as vLLM spells it. Methods: 'ngram' (prompt lookup over the sequence's own last
    `lookup_window` tokens: the longest suffix of `prompt_lookup_min`..`prompt_lookup_max` tokens that occurred before,
    and the tokens that followed it), 'eagle3' (a drafter model, `model`), and for tests and benchmarks only:
    'oracle' (proposes a known continuation: the request's prompt followed by one of `continuations`, full token lists
    computed beforehand, e.g. the greedy outputs; `acceptance_length` forces the mean tokens per verify step by
    corrupting one draft position per step; `force_acceptance` accepts by that schedule without comparing the drafts to
    the target's tokens: timing only, on random weights, whose near-tied bf16 logits make a verify step's argmax
    differ from a one-token step's, so that no continuation computed beforehand survives) and 'random' (uniform
    random drafts, their distribution q passed to the rejection sampler)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    lookup_window: int = 1024
    acceptance_length: float | None = None
    continuations: tuple[tuple[int, ...], ...] = ()
    force_acceptance: bool = False
    # vLLM's name and meaning: disable speculation when more than this many requests are enqueued (running +
    # waiting): such decode calls run one token per row, for loads where verifying k + 1 tokens per row costs more
    # than it gains (BENCHMARKS §13, §14b). None: always draft.
    disable_by_batch_size: int | None = None

    def __post_init__(self):
        def bad(name, why):
            raise ConfigError(f"speculative_config.{name}={getattr(self, name)!r}: {why}")

        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        if self.method not in METHODS:
            bad("method", f"one of {list(METHODS)} ('oracle' and 'random' are for tests and benchmarks)")
        k = self.num_speculative_tokens
        if not is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            bad("num_speculative_tokens", f"an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            lo, hi = (lo if lo is not None else hi or 5), (hi if hi is not None else lo or 5)
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
            if not is_int(lo) or lo < 1:
                bad("prompt_lookup_min", "an integer >= 1")
            if not is_int(hi) or hi < lo:
                bad("prompt_lookup_max", f"an integer >= prompt_lookup_min={lo}")
            if not is_int(self.lookup_window) or not hi < self.lookup_window <= 1 << 16:
                bad("lookup_window", f"an integer in ({hi}, 65536] (more than prompt_lookup_max)")
        else:
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    bad(name, "only for method 'ngram'")
        if self.method == "eagle3":
            if not isinstance(self.model, str) or not self.model:
                bad("model", "method 'eagle3' needs the drafter's checkpoint folder or Hugging Face repo id")
        elif self.model is not None:
            bad("model", f"only for method 'eagle3' (method {self.method!r} has no drafter model)")
        if self.acceptance_length is not None:
            a = self.acceptance_length
            if self.method != "oracle":
                bad("acceptance_length", "only for method 'oracle'")
            if not isinstance(a, (int, float)) or isinstance(a, bool) or not 1 <= a <= k + 1:
                bad("acceptance_length", f"a number in [1, num_speculative_tokens + 1 = {k + 1}]")
            object.__setattr__(self, "acceptance_length", float(a))
        if self.continuations:
            if self.method != "oracle":
                bad("continuations", "only for method 'oracle'")
            if not isinstance(self.continuations, (list, tuple)) or any(
                not isinstance(c, (list, tuple)) or any(not is_int(t) or t < 0 for t in c) for c in self.continuations
            ):
                bad("continuations", "a list of token-id lists")
            object.__setattr__(self, "continuations", tuple(tuple(c) for c in self.continuations))
        if self.disable_by_batch_size is not None and (
            not is_int(self.disable_by_batch_size) or self.disable_by_batch_size < 1
        ):
            bad(
                "disable_by_batch_size",
                "a positive integer (speculation is disabled when more requests are enqueued, running + waiting), "
                "or null",
            )
        if not isinstance(self.force_acceptance, bool):
            bad("force_acceptance", "true or false")
        if self.force_acceptance and self.method != "oracle":
            bad("force_acceptance", "only for method 'oracle'")

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """A config from an instance, a dict or a JSON object string (`--speculative-config`); None stays None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config: invalid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config={value!r}: a mapping such as {{'method': 'ngram', ...}}")
        known = [f.name for f in dataclasses.fields(cls)]
        for key in value:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.5)
                hint = f"did you mean '{close[0]}'? " if close else ""
                raise ConfigError(f"speculative_config: unknown field '{key}' ({hint}known: {known})")
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ConfigError(f"speculative_config.{key}: required")
        return cls(**value)

    def reference(self, token_ids: list[int]) -> list[int]:
        """The oracle's known sequence for a request with `token_ids` so far: the first continuation they begin,
        else the tokens themselves (nothing to propose beyond them)."""
        n = len(token_ids)
        for c in self.continuations:
            if len(c) > n and list(c[:n]) == token_ids:
                return list(c)
        return token_ids


@struct.dataclass
class DraftState:
    """What drafters keep per sequence slot on the device, across calls (donated to the decode step): the token at
    position p in column p % N of `history_SN` (-1: unknown). The host writes a sequence's tokens when its prompt
    is complete (`steps.write_history`), the decode step each token it feeds or emits."""

    history_SN: jax.Array  # i32
    # Where each slot's sequence stands after the last speculative call: its next input token and position (the host
    # learns them only when it reads the call, so the next call, dispatched before, resumes from these).
    next_token_S: jax.Array  # i32
    next_pos_S: jax.Array  # i32
    # EAGLE-3 only (`Eagle3Drafter.extend_state`; None otherwise): each slot's next k drafts, drawn after its last
    # target step, the draft-vocabulary distributions they came from, and the drafter's paged K/V.
    drafts_SK: jax.Array | None = None  # i32
    q_SKV: jax.Array | None = None  # f32 [S, k, Vd]
    kv: eagle3.DraftKV | None = None

    @staticmethod
    def empty(num_slots: int, history_tokens: int) -> DraftState:
        zeros = jnp.zeros(num_slots, jnp.int32)
        return DraftState(jnp.full((num_slots, history_tokens), -1, jnp.int32), zeros, zeros - 1)

    def record(self, slots_B: jax.Array, tokens_BT: jax.Array, positions_BT: jax.Array) -> DraftState:
        """Tokens at positions (-1: nothing) into the rows' slots."""
        S, N = self.history_SN.shape
        s = jnp.where(positions_BT >= 0, slots_B[:, None], S)  # out of range: dropped
        hist = self.history_SN.at[s, jnp.maximum(positions_BT, 0) % N].set(tokens_BT, mode="drop")
        return self.replace(history_SN=hist)


@struct.dataclass
class DraftInputs:
    """A decode iteration's state as drafters see it: each row's last token (at `pos_B`, already in the
    `DraftState`), its slot, and a PRNG key for the drafter's own draws (the row's key folded with the position)."""

    tokens_B: jax.Array
    pos_B: jax.Array  # -1: padding row
    slots_B: jax.Array
    keys_B2: jax.Array  # u32 [B, 2] raw PRNG key data


@struct.dataclass
class Draft:
    """k proposed tokens per row and, for drafters that sample them, the distribution they were drawn from
    (`q_BKV`, rows summing to 1); None means deterministic proposals (q one-hot at the token). A drafter with a
    vocabulary of its own gives q over it and `q_ids_V`, the target id of each of its columns: `verify` maps q to
    the target's vocabulary only when a row samples. `accept_BK` (the forced oracle only) decides acceptance in
    place of the target."""

    tokens_BK: jax.Array
    q_BKV: jax.Array | None = None
    q_ids_V: jax.Array | None = None
    accept_BK: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
    """Prompt lookup on device: the longest suffix (`lookup_min`..`lookup_max` tokens) of the sequence that occurred
    earlier in its last `history_tokens` tokens, most recent occurrence first; proposes the tokens after it, repeating
    the matched period where they run past the present. A row without any match proposes its last token repeated."""

    num_tokens: int
    lookup_min: int
    lookup_max: int
    history_tokens: int

    def propose(self, params, state: DraftState, inp: DraftInputs) -> Draft:
        N, n_max, k = self.history_tokens, self.lookup_max, self.num_tokens
        hist_BN = state.history_SN[inp.slots_B]
        p = jnp.maximum(inp.pos_B, 0)[:, None, None]
        d = jnp.arange(1, N - n_max + 1)[None, :, None]  # candidate match ends at p - d
        i = jnp.arange(n_max)[None, None, :]
        B, D = hist_BN.shape[0], N - n_max

        def at(pos):  # tokens at absolute positions (-2 before the sequence: matches nothing)
            flat = jnp.take_along_axis(hist_BN, (jnp.maximum(pos, 0) % N).reshape(B, -1), axis=1).reshape(pos.shape)
            return jnp.where(pos >= 0, flat, -2)

        suffix = at(p - i)  # [B, 1, n]
        cand = at(p - d - i)  # [B, D, n]
        same = (cand == suffix) & (suffix >= 0)
        length = jnp.sum(jnp.cumprod(same, axis=-1), axis=-1)  # [B, D] matched suffix tokens
        score = jnp.where(length >= self.lookup_min, length * (D + 1) + (D - d[..., 0]), -1)
        best = jnp.argmax(score, axis=1)
        found = jnp.max(score, axis=1) >= 0
        period = best + 1  # the match ends `period` tokens before the present
        t = jnp.arange(k)[None, :]
        src = inp.pos_B[:, None] - period[:, None] + 1 + t % period[:, None]
        tokens = jnp.where(found[:, None], at(src[:, :, None])[..., 0], inp.tokens_B[:, None])
        return Draft(jnp.maximum(tokens, 0).astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class OracleDrafter:
    """Tests and benchmarks only: proposes the tokens the `DraftState` holds after the present (the host wrote the
    request's known continuation there, `SpeculativeConfig.reference`). Its `params` are the acceptance length L (a
    f32 scalar on the device, so that every L shares one program): it corrupts draft position n + 1 (n drawn per row
    and step: floor(L - 1), or one more with probability frac(L - 1)), so an exact continuation is accepted for
    L - 1 drafts per step on average, L tokens per step (L = k + 1: nothing corrupted). With `force` the first n
    drafts are accepted as they are (`SpeculativeConfig.force_acceptance`)."""

    num_tokens: int
    history_tokens: int
    vocab_size: int
    force: bool = False

    def params(self, spec: SpeculativeConfig, target_params=None) -> jax.Array:
        length = spec.acceptance_length if spec.acceptance_length is not None else self.num_tokens + 1
        return jnp.float32(length)

    def propose(self, params, state: DraftState, inp: DraftInputs) -> Draft:
        k, N = self.num_tokens, self.history_tokens
        pos = inp.pos_B[:, None] + jnp.arange(1, k + 1)[None, :]
        tokens = jnp.where(pos < N, state.history_SN[inp.slots_B[:, None], jnp.clip(pos, 0, N - 1)], 0)
        tokens = jnp.maximum(tokens, 0)
        a = params - 1
        u = jax.vmap(jax.random.uniform)(inp.keys_B2)
        n = jnp.floor(a).astype(jnp.int32) + (u < a - jnp.floor(a))
        if self.force:
            return Draft(tokens.astype(jnp.int32), accept_BK=jnp.arange(k)[None, :] < n[:, None])
        spoil = jnp.arange(k)[None, :] == n[:, None]
        return Draft(jnp.where(spoil, (tokens + 1) % self.vocab_size, tokens).astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class RandomDrafter:
    """Tests only: k tokens drawn uniformly from the vocabulary, q = uniform (a drafter whose q is not one-hot)."""

    num_tokens: int
    vocab_size: int
    history_tokens: int = 1

    def propose(self, params, state: DraftState, inp: DraftInputs) -> Draft:
        B, k, V = inp.tokens_B.shape[0], self.num_tokens, self.vocab_size
        tokens = jax.vmap(lambda key: jax.random.randint(key, (k,), 0, V, jnp.int32))(inp.keys_B2)
        return Draft(tokens, jnp.full((B, k, V), 1.0 / V, jnp.float32))


@dataclasses.dataclass(frozen=True)
class Eagle3Drafter:
    """An EAGLE-3 drafter model (`gptoss_jax.eagle3`, docs/speculative.md). It drafts after each target step rather
    than before the next: `after_prefill` and `after_verify` run its first pass over the step's rows (the target's
    aux states at `aux_layers`, the tokens that follow them), which writes its K/V there, then its k - 1 further
    steps, and keep the k drafts per slot in the `DraftState`; `propose` hands them to the next verify step."""

    num_tokens: int
    cfg: eagle3.Eagle3Config
    history_tokens: int = 1

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.cfg.aux_layer_ids

    def params(self, spec: SpeculativeConfig, target_params) -> eagle3.DrafterParams:
        """The weights in the target's dtype; a drafter without an embedding shares the target's."""
        embed = target_params.embed
        try:
            return eagle3.load_weights(resolve_model(spec.model), self.cfg, embed.dtype, target_embed=embed)
        except CheckpointError as e:
            raise CheckpointError(f"speculative_config.model={spec.model!r}: {e}") from None

    def extend_state(self, state: DraftState, num_pages: int, page_size: int, dtype) -> DraftState:
        """`state` with this drafter's per-slot drafts and a K/V pool of the target's full-layer page count."""
        S, k, Vd = state.next_token_S.shape[0], self.num_tokens, self.cfg.draft_vocab_size
        return state.replace(
            drafts_SK=jnp.zeros((S, k), jnp.int32),
            q_SKV=jnp.zeros((S, k, Vd), jnp.float32),
            kv=eagle3.DraftKV.zeros(self.cfg, num_pages, page_size, dtype),
        )

    def propose(self, params, state: DraftState, inp: DraftInputs) -> Draft:
        ids = eagle3.to_target(params, jnp.arange(self.cfg.draft_vocab_size))
        return Draft(state.drafts_SK[inp.slots_B], state.q_SKV[inp.slots_B], ids)

    def _draft(self, params, state, aux, tokens_BT, positions_BT, tables, slots_B, temperature_B, keys_B2):
        pages = eagle3.Pages(tables.full_BM, tables.full_cached_B)
        prop = eagle3.propose(
            params,
            self.cfg,
            state.kv,
            tokens_BT,
            aux,
            positions_BT,
            pages,
            temperature_B,
            keys_B2,
            num_tokens=self.num_tokens,
        )
        S = state.drafts_SK.shape[0]
        real = jnp.where(jnp.max(positions_BT, axis=1) >= 0, slots_B, S)  # rows without a position: dropped
        return state.replace(
            drafts_SK=state.drafts_SK.at[real].set(prop.tokens, mode="drop"),
            q_SKV=state.q_SKV.at[real].set(prop.probs, mode="drop"),
            kv=prop.kv,
        )

    def after_prefill(self, params, state, aux, tokens_BT, positions_BT, next_B, tables, slots_B, sb, keys_B2):
        """A prefill chunk's rows: row t's token is the chunk's token t + 1; the last row's is `next_B` (the prompt's
        next token, or the token the prefill just sampled). The slot's next token and position become those the
        drafts follow (as after a verify step)."""
        shifted = jnp.concatenate([tokens_BT[:, 1:], tokens_BT[:, :1]], axis=1)
        last = jnp.argmax(positions_BT, axis=1)
        t = jnp.arange(tokens_BT.shape[1])[None, :]
        tokens = jnp.where(t == last[:, None], next_B[:, None], shifted)
        state = self._draft(params, state, aux, tokens, positions_BT, tables, slots_B, sb.temperature_B, keys_B2)
        end_B = jnp.max(positions_BT, axis=1)
        real = jnp.where(end_B >= 0, slots_B, state.next_pos_S.shape[0])  # padding rows: dropped
        return state.replace(
            next_token_S=state.next_token_S.at[real].set(next_B, mode="drop"),
            next_pos_S=state.next_pos_S.at[real].set(end_B + 1, mode="drop"),
        )

    def after_verify(self, params, state, aux, out_BT, n_B, pos_B, tables, slots_B, sb, keys_B2):
        """A verify step's accepted rows: position pos + j (j <= n) is followed by `out_BT[:, j]`."""
        j = jnp.arange(out_BT.shape[1])[None, :]
        positions = jnp.where((j <= n_B[:, None]) & (pos_B[:, None] >= 0), pos_B[:, None] + j, -1)
        tokens = jnp.maximum(out_BT, 0)
        return self._draft(params, state, aux, tokens, positions, tables, slots_B, sb.temperature_B, keys_B2)


def make_drafter(spec: SpeculativeConfig, vocab_size: int, max_model_len: int, target: ModelConfig | None = None):
    """The drafter of a config (static: part of the step's `StepConfig`). An EAGLE-3 drafter's config is read and
    checked against the `target` model here (its folder or Hugging Face repo id resolved as the target's are)."""
    k = spec.num_speculative_tokens
    if spec.method == "ngram":
        window = min(spec.lookup_window, max(max_model_len, spec.prompt_lookup_max + 1))
        return NgramDrafter(k, spec.prompt_lookup_min, spec.prompt_lookup_max, window)
    if spec.method == "oracle":
        return OracleDrafter(k, max_model_len, vocab_size, spec.force_acceptance)
    if spec.method == "random":
        return RandomDrafter(k, vocab_size)
    if target is None:
        raise ValueError("an EAGLE-3 drafter needs the target's ModelConfig")
    try:
        return Eagle3Drafter(k, eagle3.load_config(resolve_model(spec.model), target))
    except (ConfigError, CheckpointError) as e:
        raise type(e)(f"speculative_config.model={spec.model!r}: {e}") from None


def drafts(tokens_B: jax.Array, draft: Draft, pos_B: jax.Array, drafting_B: jax.Array):
    """The verify forward's inputs: each row's last token then its drafts `[B, k + 1]`, at consecutive positions
    for drafting rows; other rows keep their one token (the draft columns are padding, -1)."""
    k = draft.tokens_BK.shape[1]
    offs = jnp.arange(k + 1)[None, :]
    keep = (drafting_B[:, None] | (offs == 0)) & (pos_B[:, None] >= 0)
    return jnp.concatenate([tokens_B[:, None], draft.tokens_BK], 1), jnp.where(keep, pos_B[:, None] + offs, -1)


def verify(
    logits_BTV: jax.Array,
    draft: Draft,
    drafting_B: jax.Array,
    first_B: jax.Array | None,
    pos_B: jax.Array,
    sb: sampling.SamplingBatch,
    plain: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Accept a prefix of each drafting row's k drafts against the target's logits at its k + 1 positions.

    Greedy rows (temperature 0) keep drafts while each equals the target's argmax, then add the argmax after them.
    Sampled rows test draft x at position j with probability min(1, p(x) / q(x)), p being the target's distribution
    after the row's temperature, top-k, top-p and min-p, and on the first rejection draw from norm(max(0, p - q))
    (q one-hot for deterministic drafters: p without x, renormalised); with every draft accepted, the last position
    draws from p. Each row's draws use its key folded with the position predicted from, so they depend neither on
    batch neighbours nor on how far earlier drafts got. Rows that do not draft take `first_B` (the ordinary sampler's
    token at position 0: their logits processors and structured-output masks apply there).

    `plain` (static): every row is greedy, so the sampled rows' pass is not traced (no conditional), and `first_B`
    may be None: the argmax at the first position.

    -> (tokens `[B, k + 1]`: the accepted drafts and the target's token after them, -1 beyond; accepted counts `[B]`).
    """
    B, T, V = logits_BTV.shape
    k = T - 1
    d_BK = draft.tokens_BK
    greedy_BT = jnp.argmax(logits_BTV, axis=-1).astype(jnp.int32)
    sampled_B = (sb.temperature_B > 0) & drafting_B
    if first_B is None:
        assert plain, "only greedy rows take the first position's argmax"
        first_B = greedy_BT[:, 0]

    def rejection():
        rep = lambda a: jnp.repeat(a, T, axis=0)  # noqa: E731 - per row -> per (row, position)
        p_BTV = sampling.filtered_probs(
            logits_BTV.reshape(B * T, V),
            rep(sb.temperature_B),
            rep(sb.top_k_B),
            rep(sb.top_p_B),
            rep(sb.min_p_B),
        ).reshape(B, T, V)
        # [B, T] keys, as the ordinary sampler folds them (the row's key with the position predicted from), salted
        fold = jax.vmap(jax.vmap(jax.random.fold_in))
        base = fold(jnp.repeat(sb.keys_B2[:, None], T, axis=1), pos_B[:, None] + jnp.arange(T)[None, :])
        salted = lambda salt: fold(base, jnp.full((B, T), salt, jnp.int32))  # noqa: E731
        p_x = jnp.take_along_axis(p_BTV[:, :k], d_BK[..., None], axis=-1)[..., 0]
        if draft.q_BKV is None:  # q one-hot: the residual is p without the draft (none at the last position)
            q_x = jnp.ones_like(p_x)
            ids = jax.lax.broadcasted_iota(jnp.int32, p_BTV.shape, 2)
            residual = jnp.where(ids == jnp.pad(d_BK, ((0, 0), (0, 1)), constant_values=-1)[..., None], 0.0, p_BTV)
        else:
            q = draft.q_BKV
            if draft.q_ids_V is not None:
                q = jnp.zeros((B, k, V), q.dtype).at[:, :, draft.q_ids_V].set(q)
            q_x = jnp.take_along_axis(q, d_BK[..., None], axis=-1)[..., 0]
            residual = jnp.maximum(p_BTV - jnp.pad(q, ((0, 0), (0, 1), (0, 0))), 0.0)
        u = jax.vmap(jax.vmap(jax.random.uniform))(salted(ACCEPT_SALT)[:, :k])
        accept = u * q_x < p_x
        resample = jax.vmap(jax.vmap(lambda key, w: jax.random.categorical(key, jnp.log(w))))(
            salted(RESAMPLE_SALT), residual
        )
        return accept, resample.astype(jnp.int32)

    off = (jnp.zeros((B, k), bool), jnp.zeros((B, T), jnp.int32))
    accept_s, token_s = off if plain else jax.lax.cond(jnp.any(sampled_B), rejection, lambda: off)
    accept = jnp.where(sampled_B[:, None], accept_s, d_BK == greedy_BT[:, :k]) & drafting_B[:, None]
    if draft.accept_BK is not None:
        accept = draft.accept_BK & drafting_B[:, None]
    token_BT = jnp.where(sampled_B[:, None], token_s, greedy_BT)
    n_B = jnp.sum(jnp.cumprod(accept, axis=1), axis=1).astype(jnp.int32)
    last = jnp.where(drafting_B, jnp.take_along_axis(token_BT, n_B[:, None], axis=1)[:, 0], first_B)
    j = jnp.arange(T)[None, :]
    d_BT = jnp.pad(d_BK, ((0, 0), (0, 1)))
    out = jnp.where(j < n_B[:, None], d_BT, jnp.where(j == n_B[:, None], last[:, None], -1))
    return jnp.where(pos_B[:, None] >= 0, out, -1), n_B
