"""The compiled device steps of the engine: chunked prefill, multi-step decode, prompt logits, and the
last-token table that feeds one call's sampled tokens to the next without a host round trip.

Each is one `jax.jit` program per shape bucket with the KV cache donated (updated in place). Sampling
runs on device: every row carries its own PRNG key, folded with the position being predicted from,
so a request's draws do not depend on its batch neighbours, on chunking, or on preemption.
"""

from __future__ import annotations

import collections
import contextlib
import functools

import jax
import jax.numpy as jnp
from flax import struct
from jax import monitoring
from jax._src import dispatch  # the name of XLA's compile event

from gptoss_jax import model, sampling
from gptoss_jax.config import ModelConfig
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


@struct.dataclass
class SamplingBatch:
    temperature_B: jax.Array  # f32
    top_k_B: jax.Array        # i32
    top_p_B: jax.Array        # f32
    min_p_B: jax.Array        # f32
    keys_B2: jax.Array        # u32 [B, 2] raw PRNG key data
    want_logprobs_B: jax.Array  # bool


@struct.dataclass
class Sampled:
    tokens: jax.Array    # i32 [..., B]
    logprob: jax.Array   # f32 [..., B] of the sampled token
    top_ids: jax.Array   # i32 [..., B, num_top]
    top_lps: jax.Array   # f32 [..., B, num_top]


def _sampler(layout, num_top: int):
    """`_sample`, run per attention rank under a layout (rows are independent; the sampler's batch-wide
    shortcuts then stay inside a rank instead of gathering every rank's logits)."""
    fn = lambda logits_BV, pos_B, sp: _sample(logits_BV, pos_B, sp, num_top)
    return fn if layout is None else layout.per_rank(fn, ("rows", "rows", "rows"), "rows")


def _sample(logits_BV: jax.Array, pos_B: jax.Array, sp: SamplingBatch, num_top: int) -> Sampled:
    keys = jax.vmap(jax.random.fold_in)(sp.keys_B2, pos_B)
    tokens = sampling.sample(logits_BV, keys, sp.temperature_B, sp.top_k_B, sp.top_p_B, sp.min_p_B)
    B = tokens.shape[0]
    empty = (jnp.zeros(B, jnp.float32), jnp.zeros((B, num_top), jnp.int32), jnp.zeros((B, num_top), jnp.float32))
    lp = jax.lax.cond(jnp.any(sp.want_logprobs_B), lambda: sampling.logprobs(logits_BV, tokens, num_top),
                      lambda: empty)
    return Sampled(tokens, *lp)


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "layout", "num_top"), donate_argnames=("cache",))
def prefill(params: Params, cache: model.PagedKVCache, tokens_BT: jax.Array, positions_BT: jax.Array,
            tables: model.PageTables, last_B: jax.Array, sp: SamplingBatch, *, cfg: ModelConfig, kernels: KernelConfig, layout=None,
            num_top: int) -> tuple[Sampled, model.PagedKVCache]:
    """One chunk per row (positions -1 pad); samples the token after each row's column `last_B`."""
    TRACES["prefill"] += 1
    x, cache, _ = model.forward(params, cache, tokens_BT, positions_BT, tables, cfg, kernels, layout=layout)
    with jax.named_scope("sample"):
        last_x = jnp.take_along_axis(x, last_B[:, None, None], axis=1)[:, 0]
        pos_B = jnp.take_along_axis(positions_BT, last_B[:, None], axis=1)[:, 0]
        return _sampler(layout, num_top)(model.unembed(params, last_x), pos_B, sp), cache


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "layout", "num_steps", "num_top"), donate_argnames=("cache",))
def decode(params: Params, cache: model.PagedKVCache, tokens_B: jax.Array, positions_B: jax.Array,
           tables: model.PageTables, sp: SamplingBatch, *, cfg: ModelConfig, kernels: KernelConfig, layout=None, num_steps: int,
           num_top: int) -> tuple[Sampled, model.PagedKVCache]:
    """`num_steps` decode steps on device, each feeding back the token it sampled (outputs `[steps, B]`).
    Rows at position -1 are padding and stay so."""
    TRACES["decode"] += 1

    def one(carry, _):
        cache, tok_B, pos_B = carry
        x, cache, _ = model.forward(params, cache, tok_B[:, None], pos_B[:, None], tables, cfg, kernels, layout=layout)
        with jax.named_scope("sample"):
            out = _sampler(layout, num_top)(model.unembed(params, x[:, 0]), pos_B, sp)
        return (cache, out.tokens, jnp.where(pos_B >= 0, pos_B + 1, -1)), out

    (cache, _, _), outs = jax.lax.scan(one, (cache, tokens_B, positions_B), None, length=num_steps)
    return outs, cache


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


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "layout"), donate_argnames=("cache",))
def prompt_logits(params: Params, cache: model.PagedKVCache, tokens_BT: jax.Array, positions_BT: jax.Array,
                  tables: model.PageTables, *, cfg: ModelConfig, kernels: KernelConfig, layout=None) -> tuple[jax.Array, model.PagedKVCache]:
    """Logits `[B, T, V]` (fp32) at every position of a prefill chunk."""
    TRACES["prompt_logits"] += 1
    x, cache, _ = model.forward(params, cache, tokens_BT, positions_BT, tables, cfg, kernels, layout=layout)
    return model.unembed(params, x), cache
