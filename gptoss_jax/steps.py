"""The compiled device steps of the engine: chunked prefill, multi-step decode, prompt logits, and the
last-token table that feeds one call's sampled tokens to the next without a host round trip.

Each is one `jax.jit` program per shape bucket with the KV cache donated (updated in place), taking its inputs as
one fixed-shape batch struct and its static settings as one `StepConfig`. Sampling runs on device
(`sampling.sample_batch`): every row carries its own PRNG key, folded with the position being predicted from.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct
from jax import monitoring
from jax._src import dispatch  # the name of XLA's compile event

from gptoss_jax import model, sampling, speculative, upload
from gptoss_jax.config import ModelConfig
from gptoss_jax.sampling import Sampled, SamplerState, SamplingBatch, SamplingLists
from pallas_kernels import KernelConfig
from pallas_kernels.params import Params

# Traces per step function. Each trace is one XLA compilation, so a serving process whose counts stop
# growing after warm-up never compiles per request.
TRACES: collections.Counter[str] = collections.Counter()


@contextlib.contextmanager
def compilations():
    """`(function, seconds)` for each XLA compilation while the block runs. `TRACES` counts traces only: a
    program compiled again for a reused trace (arguments that came back committed, say) shows here alone."""
    seen: list[tuple[str, float]] = []

    def on_event(event: str, seconds: float, **kw):
        if event == dispatch.BACKEND_COMPILE_EVENT:
            seen.append((kw.get("fun_name"), seconds))

    monitoring.register_event_duration_secs_listener(on_event)
    try:
        yield seen
    finally:
        monitoring.unregister_event_duration_listener(on_event)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """A step's static settings (part of every compiled program's cache key)."""

    cfg: ModelConfig
    kernels: KernelConfig  # resolved for the device (`KernelConfig.for_device`)
    layout: object = None  # `sharding.rules.Layout`, or None on one device
    num_top: int = 1  # log-probability alternatives sampled along
    num_steps: int = 1  # decode tokens per call, fed back on device
    drafter: object = None  # with speculative decoding: the drafter (`speculative.make_drafter`), else None
    draft: bool = True  # False: speculation disabled for this call (`disable_by_batch_size`): one token per row
    # True: every row of the call is greedy, without logits processors, a structured-output mask or log-probabilities
    # (`runner.plain`), so the sampler and the verifier are traced without their conditionals, each of which makes
    # the device wait (BENCHMARKS §24)
    plain: bool = False


@struct.dataclass
class PrefillBatch:
    """One chunk per row; positions -1 pad. Samples the token after each row's column `last_B`."""

    tokens_BT: jax.Array  # i32
    positions_BT: jax.Array  # i32
    tables: model.PageTables
    last_B: jax.Array  # i32
    sampling: SamplingBatch
    lists: SamplingLists  # the rows' logits-processor lists, written to their slots of the `SamplerState`


@struct.dataclass
class DecodeBatch:
    """One token per row at `positions_B` (-1: padding rows, which stay so)."""

    tokens_B: jax.Array  # i32
    positions_B: jax.Array  # i32
    tables: model.PageTables
    sampling: SamplingBatch
    # i32 [B, steps]: step k's input from the host where >= 0 (tokens forced onto a structured output, fed one per
    # step instead of a prefill call), else step k - 1's sample; column 0 unused (`tokens_B`)
    fed_BS: jax.Array
    # i32 [B]: the position of each row's last token (its length limit, `Sequence.max_len - 1`). An input there or
    # after makes no token the row keeps: the forward takes it as padding (`useful`), and a step with none but such
    # inputs skips the kernels' weight reads (`pallas_kernels.layer_index`), where a request ended by length spent
    # 0-7 full steps of its last call.
    last_B: jax.Array


def _sampler(st: StepConfig, branchless: bool = False):
    """`sampling.sample_batch`, run per attention rank under a layout (rows are independent; the sampler's
    batch-wide shortcuts then stay inside a rank instead of gathering every rank's logits; the `SamplerState`,
    indexed by slot, is the same on every rank). `branchless` for prefill calls (`sampling.shortcut`)."""

    def fn(logits_BV, pos_B, sb, state):
        return sampling.sample_batch(logits_BV, pos_B, sb, st.num_top, state, branchless, st.plain)

    return fn if st.layout is None else st.layout.per_rank(fn, ("rows", "rows", "rows", None), "rows")


@functools.partial(jax.jit, static_argnames=("st",), donate_argnames=("cache", "state"))
def prefill(
    params: Params, cache: model.PagedKVCache, state: SamplerState, batch: PrefillBatch, *, st: StepConfig
) -> tuple[Sampled, model.PagedKVCache, SamplerState]:
    TRACES["prefill"] += 1
    batch = upload.unpack(batch)  # one transfer's words, sliced back (`runner._upload_step`)
    x, cache, _ = model.forward(
        params, cache, batch.tokens_BT, batch.positions_BT, batch.tables, st.cfg, st.kernels, layout=st.layout
    )
    sampled, state = _sample_prefill(params, x, state, batch, st)
    return sampled, cache, state


def _sample_prefill(params, x, state: SamplerState, batch: PrefillBatch, st: StepConfig):
    with jax.named_scope("sample"):
        state = sampling.record_prefill(
            state, batch.sampling, batch.lists, batch.tokens_BT, batch.positions_BT, batch.last_B
        )
        last_x = jnp.take_along_axis(x, batch.last_B[:, None, None], axis=1)[:, 0]
        pos_B = jnp.take_along_axis(batch.positions_BT, batch.last_B[:, None], axis=1)[:, 0]
        # Branchless: a conditional here would hold the host until the forward pass is done (`sampling.shortcut`).
        sb = batch.sampling.replace(masked_B=sampling.mask_applies(batch.sampling, state, pos_B))
        sampled = _sampler(st, branchless=True)(model.unembed(params, last_x), pos_B, sb, state)
        return sampled, state


@struct.dataclass
class DraftingPrefillBatch:
    """A prefill batch for a drafter that drafts from the target's hidden states (`speculative.Eagle3Drafter`):
    `next_B` is the token after each row's chunk where the host knows it (the prompt's next), -1 where it is the
    token this call samples."""

    prefill: PrefillBatch
    next_B: jax.Array  # i32


@functools.partial(jax.jit, static_argnames=("st",), donate_argnames=("cache", "state"))
def prefill_drafting(
    params: tuple[Params, object],
    cache: model.PagedKVCache,
    state: tuple[SamplerState, speculative.DraftState],
    batch: DraftingPrefillBatch,
    *,
    st: StepConfig,
) -> tuple[Sampled, model.PagedKVCache, tuple[SamplerState, speculative.DraftState]]:
    """`prefill` that also records the target's hidden states at the drafter's aux layers and runs the drafter
    over the chunk (`after_prefill`: its K/V for every chunk position, and its first drafts for the row's slot)."""
    TRACES["prefill_drafting"] += 1
    batch = upload.unpack(batch)  # one transfer's words, sliced back (`runner._upload_step`)
    (target, draft_params), (sstate, dstate), b = params, state, batch.prefill
    x, cache, _, aux = model.forward(
        target, cache, b.tokens_BT, b.positions_BT, b.tables, st.cfg, st.kernels, aux_layers=st.drafter.aux_layers
    )
    sampled, sstate = _sample_prefill(target, x, sstate, b, st)
    with jax.named_scope("draft"):
        slots_B = b.sampling.proc_B4[:, 3]
        next_B = jnp.where(batch.next_B >= 0, batch.next_B, sampled.tokens)
        pos_B = jnp.max(b.positions_BT, axis=1) + 1  # the position the next token sits at
        dstate = st.drafter.after_prefill(
            draft_params,
            dstate,
            aux,
            b.tokens_BT,
            b.positions_BT,
            next_B,
            b.tables,
            slots_B,
            b.sampling,
            _draft_keys(b.sampling.keys_B2, pos_B),
        )
    return sampled, cache, (sstate, dstate)


def _draft_keys(keys_B2: jax.Array, pos_B: jax.Array) -> jax.Array:
    """The keys of a drafter's own draws for rows whose next input sits at `pos_B`: the row's key folded with the
    position, salted."""
    fold = jax.vmap(jax.random.fold_in)
    return fold(fold(keys_B2, pos_B), jnp.full_like(pos_B, speculative.DRAFT_SALT))


def useful(positions_BT: jax.Array, batch: DecodeBatch) -> jax.Array:
    """The positions whose tokens a row may keep, the others -1 (padding): an input at the row's last position
    (`DecodeBatch.last_B`) or after it makes a token past the length limit, which the host drops."""
    return jnp.where(positions_BT < batch.last_B[:, None], positions_BT, -1)


@functools.partial(jax.jit, static_argnames=("st",), donate_argnames=("cache", "state"))
def decode(
    params: Params, cache: model.PagedKVCache, state: SamplerState, batch: DecodeBatch, *, st: StepConfig
) -> tuple[Sampled, model.PagedKVCache, SamplerState]:
    """`st.num_steps` decode steps on device, each feeding back the token it sampled (outputs `[steps, B]`); the
    logits processors' state takes each step's input token first, so penalties see the tokens of this call."""
    TRACES["decode"] += 1
    batch = upload.unpack(batch)  # one transfer's words, sliced back (`runner._upload_step`)

    def one(carry, k):
        cache, state, tok_B, pos_B = carry
        fed_B = batch.fed_BS[:, k]
        tok_B = jnp.where(fed_B >= 0, fed_B, tok_B)
        pos_B1 = useful(pos_B[:, None], batch)  # an input past the row's length limit as padding
        x, cache, _ = model.forward(
            params, cache, tok_B[:, None], pos_B1, batch.tables, st.cfg, st.kernels, layout=st.layout
        )
        with jax.named_scope("sample"):
            state = sampling.record_input(state, batch.sampling, tok_B, pos_B)
            # A structured-output mask holds for the token at its position (after the fed ones; it depends on the
            # tokens before) and, inside a JSON string, for the tokens after it while they stay in the string; other
            # steps draw freely and the host keeps what the grammar accepts.
            sb = batch.sampling.replace(masked_B=sampling.mask_applies(batch.sampling, state, pos_B))
            out = _sampler(st)(model.unembed(params, x[:, 0]), pos_B, sb, state)
        return (cache, state, out.tokens, jnp.where(pos_B >= 0, pos_B + 1, -1)), out

    carry = (cache, state, batch.tokens_B, batch.positions_B)
    (cache, state, _, _), outs = jax.lax.scan(one, carry, jnp.arange(st.num_steps))
    return outs, cache, state


@struct.dataclass
class SpeculativeBatch:
    """A decode batch with speculation: `drafting_B` marks the rows that draft (the others, e.g. rows with logits
    processors or structured outputs, take one token per step as without speculation); `resume_B` the rows whose
    last call was speculative and still in flight when this one was built: their input token and position are the
    `DraftState`'s (the decode batch's are the host's guess)."""

    decode: DecodeBatch
    drafting_B: jax.Array  # bool
    resume_B: jax.Array  # bool


@functools.partial(jax.jit, static_argnames=("st",), donate_argnames=("cache", "state"))
def decode_speculative(
    params: tuple[Params, object],
    cache: model.PagedKVCache,
    state: tuple[SamplerState, speculative.DraftState],
    batch: SpeculativeBatch,
    *,
    st: StepConfig,
) -> tuple[Sampled, model.PagedKVCache, tuple[SamplerState, speculative.DraftState]]:
    """`decode` with speculation: `st.num_steps` iterations, each drafting k tokens per row (`st.drafter`), verifying
    them with the row's last token in one target forward of k + 1 tokens, accepting on device
    (`speculative.verify`) and continuing from the row's true next token and position. `params` are the target's
    and the drafter's (None for drafters without weights). Outputs `[steps * (k + 1), B]`: each step's accepted
    drafts and the target's token after them, -1 where a step produced fewer."""
    TRACES["decode_speculative"] += 1
    batch = upload.unpack(batch)  # one transfer's words, sliced back (`runner._upload_step`)
    target, draft_params = params
    d = batch.decode
    slots_B = d.sampling.proc_B4[:, 3]
    # () traces the plain forward; a call that does not draft leaves a drafter model's K/V behind (drafts only)
    aux_ids = getattr(st.drafter, "aux_layers", ()) if st.draft else ()

    k = st.drafter.num_tokens

    def one(carry, it):
        cache, sstate, dstate, tok_B, pos_B = carry
        drafting_B = batch.drafting_B & (pos_B >= 0) & st.draft
        with jax.named_scope("draft"):
            dstate = dstate.record(slots_B, tok_B[:, None], pos_B[:, None])
            keys_B2 = _draft_keys(d.sampling.keys_B2, pos_B)
            if st.draft:
                inp = speculative.DraftInputs(tok_B, pos_B, slots_B, keys_B2)
                draft = st.drafter.propose(draft_params, dstate, inp)
            else:  # one token per row; the history and the next token and position are kept as with drafts
                draft = speculative.Draft(jnp.zeros((tok_B.shape[0], 0), jnp.int32))
            tokens_BT, positions_BT = speculative.drafts(tok_B, draft, pos_B, drafting_B)
        x_BTD, cache, _, *aux = model.forward(
            target,
            cache,
            tokens_BT,
            useful(positions_BT, d),
            d.tables,
            st.cfg,
            st.kernels,
            layout=st.layout,
            aux_layers=aux_ids,
        )
        with jax.named_scope("verify"):
            logits_BTV = model.unembed(target, x_BTD)
            sstate = sampling.record_input(sstate, d.sampling, tok_B, pos_B)
            if st.draft:
                out_BT, n_B, lp = _verify(logits_BTV, draft, drafting_B, pos_B, d.sampling, sstate, st)
            else:  # one token per row, sampled as `decode` samples it: no drafts, so no verification and no more
                # conditionals than `decode` has (XLA reads each one's predicate on the host, BENCHMARKS §14b)
                sb = d.sampling.replace(masked_B=sampling.mask_applies(d.sampling, sstate, pos_B))
                out = _sampler(st)(logits_BTV[:, 0], pos_B, sb, sstate)
                n_B = jnp.zeros_like(pos_B)
                out_BT, lp = out.tokens[:, None], tuple(a[:, None] for a in (out.logprob, out.top_ids, out.top_lps))
                # the outputs keep the k + 1 columns of a drafting call (-1: no token)
                out_BT = jnp.pad(jnp.where(pos_B[:, None] >= 0, out_BT, -1), ((0, 0), (0, k)), constant_values=-1)
                lp = jax.tree.map(lambda a: jnp.pad(a, [(0, 0), (0, k)] + [(0, 0)] * (a.ndim - 2)), lp)
            emitted = jnp.where(out_BT >= 0, pos_B[:, None] + 1 + jnp.arange(k + 1)[None, :], -1)
            dstate = dstate.record(slots_B, out_BT, emitted)
        next_B = jnp.take_along_axis(out_BT, n_B[:, None], axis=1)[:, 0]
        next_pos = jnp.where(pos_B >= 0, pos_B + n_B + 1, -1)
        if aux_ids:  # a drafter model drafts the next step's tokens now, from the verified rows' hidden states
            with jax.named_scope("draft"):
                dstate = st.drafter.after_verify(
                    draft_params,
                    dstate,
                    aux[0],
                    out_BT,
                    n_B,
                    pos_B,
                    d.tables,
                    slots_B,
                    d.sampling,
                    _draft_keys(d.sampling.keys_B2, next_pos),
                )
        return (cache, sstate, dstate, next_B, next_pos), Sampled(out_BT, *lp)

    sstate, dstate = state
    tok_B = jnp.where(batch.resume_B, dstate.next_token_S[slots_B], d.tokens_B)
    pos_B = jnp.where(batch.resume_B, dstate.next_pos_S[slots_B], d.positions_B)
    carry = (cache, sstate, dstate, tok_B, pos_B)
    (cache, sstate, dstate, tok_B, pos_B), outs = jax.lax.scan(one, carry, jnp.arange(st.num_steps))
    real = jnp.where(d.positions_B >= 0, slots_B, dstate.next_pos_S.shape[0])  # padding rows: dropped
    dstate = dstate.replace(
        next_token_S=dstate.next_token_S.at[real].set(tok_B, mode="drop"),
        next_pos_S=dstate.next_pos_S.at[real].set(pos_B, mode="drop"),
    )
    # [steps, B, T, ...] -> [steps * T, B, ...]: token i of step s at index s * T + i, as the host reads them
    outs = jax.tree.map(lambda a: jnp.swapaxes(a, 1, 2).reshape(-1, a.shape[1], *a.shape[3:]), outs)
    return outs, cache, (sstate, dstate)


def _verify(logits_BTV, draft, drafting_B, pos_B, sampling_batch, sstate, st: StepConfig):
    """A drafting step's tokens: the ordinary sampler's at each row's first position (rows that do not draft take
    it), `speculative.verify`'s accepted drafts and next token, and the log-probabilities of all of them (only when
    a row asks) -> (tokens `[B, k + 1]`, accepted counts `[B]`, log-probabilities `[B, k + 1, ...]`)."""
    B, T, V = logits_BTV.shape
    first_B = None  # greedy rows alone: the argmax at the first position, which `verify` computes anyway
    if not st.plain:
        sb = sampling_batch.replace(
            masked_B=sampling.mask_applies(sampling_batch, sstate, pos_B),
            want_logprobs_B=jnp.zeros_like(sampling_batch.want_logprobs_B),
        )
        first_B = _sampler(st)(logits_BTV[:, 0], pos_B, sb, sstate).tokens
    out_BT, n_B = speculative.verify(logits_BTV, draft, drafting_B, first_B, pos_B, sampling_batch, st.plain)
    empty = lambda: sampling.no_logprobs(B * T, st.num_top)  # noqa: E731
    if st.plain:
        lp = empty()
    else:
        lp = jax.lax.cond(
            jnp.any(sampling_batch.want_logprobs_B),
            lambda: sampling.logprobs(logits_BTV.reshape(B * T, V), jnp.maximum(out_BT, 0).reshape(-1), st.num_top),
            empty,
        )
    return out_BT, n_B, jax.tree.map(lambda a: a.reshape(B, T, *a.shape[1:]), lp)


@functools.partial(jax.jit, donate_argnames=("state",))
def write_history(state: speculative.DraftState, slots_B: jax.Array, rows_BN: jax.Array) -> speculative.DraftState:
    """Replace the drafter history of the rows' slots (padding rows point at a spare slot): a sequence's tokens, and
    the oracle's known continuation, when its prompt is complete."""
    TRACES["write_history"] += 1
    return state.replace(history_SN=state.history_SN.at[slots_B].set(rows_BN))


@functools.partial(jax.jit, donate_argnames=("table_S",))
def store_tokens(table_S: jax.Array, slots_B: jax.Array, tokens_B: jax.Array) -> jax.Array:
    """Record each row's last sampled token (`tokens_B`, or the last step of `[steps, B]`) in its
    sequence's slot of the on-device last-token table (padding rows point at a spare slot), so the
    next decode call can be dispatched before the host has seen the token."""
    TRACES["store_tokens"] += 1
    return table_S.at[slots_B].set(tokens_B.reshape(-1, slots_B.shape[0])[-1])


@jax.jit
def load_tokens(table_S: jax.Array, slots_B: jax.Array, host_B: jax.Array) -> jax.Array:
    """Decode input tokens: from the last-token table where the host has not seen the token yet
    (`host_B` < 0), else `host_B` (e.g. a prompt's last token when its chunks ended just before it)."""
    TRACES["load_tokens"] += 1
    return jnp.where(host_B < 0, table_S[slots_B], host_B)


@functools.partial(jax.jit, static_argnames=("st",), donate_argnames=("cache",))
def prompt_logits(
    params: Params,
    cache: model.PagedKVCache,
    tokens_BT: jax.Array,
    positions_BT: jax.Array,
    tables: model.PageTables,
    *,
    st: StepConfig,
) -> tuple[jax.Array, model.PagedKVCache]:
    """Logits `[B, T, V]` (fp32) at every position of a prefill chunk."""
    TRACES["prompt_logits"] += 1
    x, cache, _ = model.forward(params, cache, tokens_BT, positions_BT, tables, st.cfg, st.kernels, layout=st.layout)
    return model.unembed(params, x), cache
