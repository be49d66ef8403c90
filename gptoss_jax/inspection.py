"""Looking inside the model: per-layer routing, attention-sink mass and hidden states of one sequence.

`LLM.inspect(token_ids)` runs the same jitted `model.forward` as serving with its static `inspect`
option on, through the engine's paged KV cache in prefill chunks (exactly like `LLM.logits`: same
chunks, buckets, kernels and layout), and returns an `Inspection` of numpy arrays. The option is off
everywhere else, so serving traces the very same program (tests/test_inspect.py checks the cost).
With it on the forward is unchanged and the records are side computations: the routing through
`moe_reference.route`, the function every MoE implementation routes with, and the sink mass through
the reference attention (the kernels do not expose it; this costs a second attention pass).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Sequence as Seq

import jax
import numpy as np

from gptoss_jax import model
from gptoss_jax.steps import StepConfig
from pallas_kernels.params import Params

TRACES: collections.Counter[str] = collections.Counter()  # compilations of `_step` (one per shape bucket)


@dataclasses.dataclass
class Inspection:
    """What every layer did with one token sequence (`L` layers, `T` tokens). Layer `l` is sliding-window
    when `sliding[l]` (gpt-oss: the even layers)."""

    token_ids: np.ndarray  # i32 [T]
    sliding: np.ndarray  # bool [L]
    window: int  # keys a sliding layer sees, the query included
    router_logits: np.ndarray  # f32 [L, T, E] (router bias included)
    expert_ids: np.ndarray  # i32 [L, T, k] chosen experts, best first (= top-k of router_logits)
    expert_weights: np.ndarray  # f32 [L, T, k] softmax over the k chosen logits
    sink_mass: np.ndarray  # f32 [L, T, N] attention probability each head gives its sink, in [0, 1]
    hidden_states: np.ndarray | None = None  # f32 [L, T, D] residual stream after each layer
    logits: np.ndarray | None = None  # f32 [T, V] next-token logits (as `LLM.logits`)

    @property
    def num_layers(self) -> int:
        return self.router_logits.shape[0]

    @property
    def num_experts(self) -> int:
        return self.router_logits.shape[-1]

    def expert_load(self) -> np.ndarray:
        """`[L, E]` how many (token, slot) assignments each expert received in each layer."""
        L, E = self.num_layers, self.num_experts
        out = np.zeros((L, E), np.int64)
        for l in range(L):
            out[l] = np.bincount(self.expert_ids[l].ravel(), minlength=E)
        return out

    def router_entropy(self) -> np.ndarray:
        """`[L, T]` entropy (nats) of the softmax over all router logits; log(E) is uniform routing."""
        z = self.router_logits - self.router_logits.max(-1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(-1, keepdims=True)
        return -(p * np.log(np.maximum(p, 1e-30))).sum(-1)


@functools.partial(jax.jit, static_argnames=("st", "opts", "with_logits"), donate_argnames=("cache",))
def _step(
    params: Params,
    cache: model.PagedKVCache,
    tokens_BT: jax.Array,
    positions_BT: jax.Array,
    tables: model.PageTables,
    *,
    st: StepConfig,
    opts: model.Inspect,
    with_logits: bool,
):
    TRACES["inspect"] += 1
    x, cache, rec = model.forward(
        params, cache, tokens_BT, positions_BT, tables, st.cfg, st.kernels, inspect=opts, layout=st.layout
    )
    return (model.unembed(params, x) if with_logits else None), rec, cache


def run(engine, token_ids: Seq[int], *, hidden_states: bool = False, logits: bool = False) -> Inspection:
    """Inspect one sequence on `engine` (a `gptoss_jax.Engine`) through `Engine.run_prompt`: the same
    chunks, buckets, tables, rows and layout as `Engine.prompt_logits`."""
    ids = [int(t) for t in token_ids]
    mc = engine.model_config
    step = functools.partial(
        _step, st=engine.runner.st, opts=model.Inspect(hidden_states=hidden_states), with_logits=logits
    )

    def chunk(params, cache, tokens, positions, tables):
        lg, rec, cache = step(params, cache, tokens, positions, tables)
        return (lg, rec), cache

    chunks = []
    for (lg, rec), n in engine.run_prompt(ids, chunk):
        host = jax.tree.map(lambda a: np.asarray(a[:, 0, :n]), rec)  # [L, n, ...] of row 0
        chunks.append((None if lg is None else np.asarray(lg[0, :n], np.float32), host))
    recs = [r for _, r in chunks]
    cat = lambda f: np.concatenate([getattr(r, f) for r in recs], axis=1)  # noqa: E731
    return Inspection(
        token_ids=np.asarray(ids, np.int32),
        sliding=np.array([mc.is_sliding(l) for l in range(mc.num_layers)]),
        window=mc.sliding_window,
        router_logits=cat("router_logits"),
        expert_ids=cat("expert_ids"),
        expert_weights=cat("expert_weights"),
        sink_mass=cat("sink_mass"),
        hidden_states=cat("hidden_states") if hidden_states else None,
        logits=np.concatenate([lg for lg, _ in chunks]) if logits else None,
    )
