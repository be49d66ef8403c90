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

from gptoss_jax import model, sampling
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


def _sampler(st: StepConfig, branchless: bool = False):
    """`sampling.sample_batch`, run per attention rank under a layout (rows are independent; the sampler's
    batch-wide shortcuts then stay inside a rank instead of gathering every rank's logits; the `SamplerState`,
    indexed by slot, is the same on every rank). `branchless` for prefill calls (`sampling.shortcut`)."""

    def fn(logits_BV, pos_B, sb, state):
        return sampling.sample_batch(logits_BV, pos_B, sb, st.num_top, state, branchless)

    return fn if st.layout is None else st.layout.per_rank(fn, ("rows", "rows", "rows", None), "rows")


@functools.partial(jax.jit, static_argnames=("st",), donate_argnames=("cache", "state"))
def prefill(
    params: Params, cache: model.PagedKVCache, state: SamplerState, batch: PrefillBatch, *, st: StepConfig
) -> tuple[Sampled, model.PagedKVCache, SamplerState]:
    TRACES["prefill"] += 1
    x, cache, _ = model.forward(
        params, cache, batch.tokens_BT, batch.positions_BT, batch.tables, st.cfg, st.kernels, layout=st.layout
    )
    with jax.named_scope("sample"):
        state = sampling.record_prefill(
            state, batch.sampling, batch.lists, batch.tokens_BT, batch.positions_BT, batch.last_B
        )
        last_x = jnp.take_along_axis(x, batch.last_B[:, None, None], axis=1)[:, 0]
        pos_B = jnp.take_along_axis(batch.positions_BT, batch.last_B[:, None], axis=1)[:, 0]
        # Branchless: a conditional here would hold the host until the forward pass is done (`sampling.shortcut`).
        sampled = _sampler(st, branchless=True)(model.unembed(params, last_x), pos_B, batch.sampling, state)
        return sampled, cache, state


@functools.partial(jax.jit, static_argnames=("st",), donate_argnames=("cache", "state"))
def decode(
    params: Params, cache: model.PagedKVCache, state: SamplerState, batch: DecodeBatch, *, st: StepConfig
) -> tuple[Sampled, model.PagedKVCache, SamplerState]:
    """`st.num_steps` decode steps on device, each feeding back the token it sampled (outputs `[steps, B]`); the
    logits processors' state takes each step's input token first, so penalties see the tokens of this call."""
    TRACES["decode"] += 1

    def one(carry, k):
        cache, state, tok_B, pos_B = carry
        fed_B = batch.fed_BS[:, k]
        tok_B = jnp.where(fed_B >= 0, fed_B, tok_B)
        x, cache, _ = model.forward(
            params, cache, tok_B[:, None], pos_B[:, None], batch.tables, st.cfg, st.kernels, layout=st.layout
        )
        with jax.named_scope("sample"):
            state = sampling.record_input(state, batch.sampling, tok_B, pos_B)
            # A structured-output mask holds for the call's first sampled token only (after the fed ones; it depends
            # on the tokens before); later steps draw freely and the host keeps what the grammar accepts.
            sb = batch.sampling.replace(masked_B=batch.sampling.masked_B & (k == first_sample_B))
            out = _sampler(st)(model.unembed(params, x[:, 0]), pos_B, sb, state)
        return (cache, state, out.tokens, jnp.where(pos_B >= 0, pos_B + 1, -1)), out

    first_sample_B = jnp.sum(batch.fed_BS[:, 1:] >= 0, axis=1)  # the step whose sample follows the fed tokens
    carry = (cache, state, batch.tokens_B, batch.positions_B)
    (cache, state, _, _), outs = jax.lax.scan(one, carry, jnp.arange(st.num_steps))
    return outs, cache, state


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
