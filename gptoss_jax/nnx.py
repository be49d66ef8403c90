"""`GptOss`: the model as a Flax NNX module, for research (probes, LoRA, sown intermediates) on the engine's arrays.

The module's variables are the very arrays of the engine's `Params` (`to_params` and the constructor convert without
a copy), and calling it runs the functional core, `model.forward` and `model.unembed`: the same math and kernels as
serving, one implementation. Submodules follow the model's parts (embedding, attention with its sinks, MoE with its
router and MXFP4 experts, norms, unembedding); each holds every layer stacked on a leading axis, as scanned NNX
layers do, because the forward is one `lax.scan` over layers and slicing a layer out would copy it. Intermediates
(`intermediates=True`) are sown as `nnx.Intermediate` on the submodule they come from. docs/model.md, "Flax NNX".
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from gptoss_jax import checkpoint, model
from gptoss_jax.config import ModelConfig
from gptoss_jax.engine import DTYPES
from gptoss_jax.llm import LLM
from pallas_kernels import KernelConfig
from pallas_kernels import params as params_lib
from sharding.rules import Layout

PAGE_SIZE = 16  # the call's own KV cache: each row's tokens in consecutive pages of this many
ATTENTION = ("q_w", "q_b", "k_w", "k_b", "v_w", "v_b", "o_w", "o_b", "sinks")


class MXFP4(nnx.Variable):
    """Packed expert weights (codes, scales and what the kernels derive from them): state, not trainable
    parameters, so `nnx.Param` filters (and gradients) leave them out."""


class Embedding(nnx.Module):
    def __init__(self, weight: jax.Array):
        self.weight = nnx.Param(weight)  # [V, D]


class Unembedding(nnx.Module):
    """The untied output matrix (no bias, no soft-cap)."""

    def __init__(self, weight: jax.Array):
        self.weight = nnx.Param(weight)  # [V, D]


class RMSNorm(nnx.Module):
    def __init__(self, scale: jax.Array):
        self.scale = nnx.Param(scale)  # f32 [(L,) D]


class Attention(nnx.Module):
    """Every layer's attention: its pre-norm, q/k/v/o projections with biases (`[out, in]`, stacked `[L, ...]`) and
    one learned sink logit per head."""

    def __init__(self, norm: jax.Array, **weights: jax.Array):
        self.norm = RMSNorm(norm)
        for name in ATTENTION:
            setattr(self, name, nnx.Param(weights[name]))


class RouterLoRA(nnx.Module):
    """A low-rank update of every layer's router: `w + b @ a` (`a` [L, r, D] random, `b` [L, E, r] zeros, so it
    starts as the identity update). Its variables are `nnx.LoRAParam`s, to train alone with the base frozen."""

    def __init__(self, num_layers: int, num_experts: int, hidden: int, rank: int, *, rngs: nnx.Rngs):
        self.a = nnx.LoRAParam(jax.random.normal(rngs.params(), (num_layers, rank, hidden), jnp.float32) / hidden**0.5)
        self.b = nnx.LoRAParam(jnp.zeros((num_layers, num_experts, rank), jnp.float32))


class Router(nnx.Module):
    def __init__(self, weight: jax.Array, bias: jax.Array):
        self.weight = nnx.Param(weight)  # [L, E, D]
        self.bias = nnx.Param(bias)  # [L, E]
        self.lora: RouterLoRA | None = nnx.data(None)

    def add_lora(self, rank: int, *, rngs: nnx.Rngs) -> RouterLoRA:
        L, E, D = self.weight.shape
        self.lora = RouterLoRA(L, E, D, rank, rngs=rngs)
        return self.lora

    def effective_weight(self) -> jax.Array:
        """The router weight the forward uses: the base one (the very array), or with the LoRA update added."""
        w = self.weight[...]
        if self.lora is None:
            return w
        delta = jnp.einsum("ler,lrd->led", self.lora.b[...], self.lora.a[...])
        return (w.astype(jnp.float32) + delta).astype(w.dtype)


class Experts(nnx.Module):
    """Every layer's experts in the layout the kernels read (`params.Experts`, or the Pallas kernels'
    `KernelExperts`): packed weights as `MXFP4` variables, biases as `nnx.Param`s."""

    def __init__(self, experts):
        self.kind = type(experts)
        for f in dataclasses.fields(experts):
            value = getattr(experts, f.name)
            if value is not None:
                setattr(self, f.name, nnx.Param(value) if f.name.endswith("bias") else MXFP4(value))

    def to_params(self):
        names = [f.name for f in dataclasses.fields(self.kind) if hasattr(self, f.name)]
        return self.kind(**{n: getattr(self, n)[...] for n in names})


class MoE(nnx.Module):
    """Every layer's mixture of experts: its pre-norm, the router (top-k, softmax over the chosen) and the experts."""

    def __init__(self, norm: jax.Array, router: Router, experts: Experts):
        self.norm = RMSNorm(norm)
        self.router = router
        self.experts = experts


class Layers(nnx.Module):
    def __init__(self, attn: Attention, mlp: MoE):
        self.attn = attn
        self.mlp = mlp


class GptOss(nnx.Module):
    """gpt-oss over `params` (a `Params` tree, experts in either layout) with `config`. `kernels`: which kernels run
    (`pallas_kernels.KernelConfig`, resolved for the device); `layout`: a `sharding.rules.Layout` the parameters are
    placed by, or None on one device."""

    def __init__(
        self,
        config: ModelConfig,
        params: params_lib.Params,
        *,
        kernels: KernelConfig | None = None,
        layout: Layout | None = None,
        path: Path | None = None,
    ):
        self.config, self.layout, self.path = config, layout, path
        self.kernels = (kernels or KernelConfig()).for_device()
        lp = params.layers
        self.embed = Embedding(params.embed)
        self.layers = Layers(
            Attention(lp.attn_norm, **{n: getattr(lp, n) for n in ATTENTION}),
            MoE(lp.mlp_norm, Router(lp.router_w, lp.router_b), Experts(lp.experts)),
        )
        self.final_norm = RMSNorm(params.final_norm)
        self.unembed = Unembedding(params.unembed)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        dtype: str = "bfloat16",
        mesh: Mesh | None = None,
        mode: str = "low_latency",
        impl: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        revision: str | None = None,
        download_dir: str | os.PathLike | None = None,
        progress: bool = True,
    ) -> GptOss:
        """Load a checkpoint folder (Hugging Face or `original/` layout) or a Hugging Face repo id (`revision`,
        `download_dir`: `checkpoint.resolve_model`) exactly as the engine does (`checkpoint.load_placed`). `mesh`: a
        `(replica, model)` mesh (`sharding.rules.make_mesh`) to shard over by the engine's logical-axis rules in
        parallelism `mode`; `impl`: the kernels ("reference", "pallas"; default the engine's choice for the device);
        `cache_dir`: the engine's orbax cache of converted parameters."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}: choose one of {sorted(DTYPES)}")
        kernels = (KernelConfig() if impl is None else KernelConfig(impl=impl)).for_device()
        layout = Layout(mesh, mode) if mesh is not None else None
        path = checkpoint.resolve_model(path, revision=revision, download_dir=download_dir)
        config, params = checkpoint.load_placed(
            path, DTYPES[dtype], kernels, layout, cache_dir=cache_dir, progress=progress
        )
        return cls(config, params, kernels=kernels, layout=layout, path=path)

    def to_params(self) -> params_lib.Params:
        """The engine's `Params` of this module: its variables' arrays themselves (no copy), except the router
        weight where a LoRA is attached (`Router.effective_weight`)."""
        attn, mlp = self.layers.attn, self.layers.mlp
        layers = params_lib.Layers(
            attn_norm=attn.norm.scale[...],
            **{n: getattr(attn, n)[...] for n in ATTENTION},
            mlp_norm=mlp.norm.scale[...],
            router_w=mlp.router.effective_weight(),
            router_b=mlp.router.bias[...],
            experts=mlp.experts.to_params(),
        )
        return params_lib.Params(
            embed=self.embed.weight[...],
            layers=layers,
            final_norm=self.final_norm.scale[...],
            unembed=self.unembed.weight[...],
        )

    def to_llm(self, **kwargs) -> LLM:
        """A serving `gptoss_jax.LLM` over this module's parameters (shared, not copied; a LoRA is merged into
        the router weight first). `kwargs`: `LLM`'s engine settings."""
        return LLM.from_params(self.config, self.to_params(), model=self.path, layout=self.layout, **kwargs)

    def __call__(
        self, token_ids: jax.Array, positions: jax.Array | None = None, *, intermediates: bool = False
    ) -> jax.Array:
        """Next-token logits (fp32) `[B, T, V]` for token ids `[B, T]` (or `[T, V]` for `[T]`), through
        `model.forward` on a KV cache of the call's own. `positions` (same shape; default `0..T-1` on every row):
        each row's positions count from 0 and -1 marks padding; a row attends only to the tokens it holds.

        `intermediates=True` also sows, stacked over layers `[L, B, T, ...]` (run under `nnx.capture(model,
        nnx.Intermediate)`): on `layers` the residual stream after each layer (`hidden_states`); on `layers.mlp`
        `router_logits` (bias included), the chosen `expert_ids` (best first) and their `expert_weights`; on
        `layers.attn` each head's `sink_mass`. It costs the reference attention a second time (`model.Inspect`)."""
        tokens = jnp.asarray(token_ids, jnp.int32)
        if tokens.ndim not in (1, 2) or tokens.size == 0:
            raise ValueError(f"token_ids of shape {tokens.shape}: expected [T] or [B, T] with T > 0")
        single = tokens.ndim == 1
        tokens = tokens[None] if single else tokens
        B, T = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)) if positions is None else positions
        pos = jnp.asarray(pos, jnp.int32)
        if pos.shape != tokens.shape and pos.shape != (T,):
            raise ValueError(f"positions of shape {pos.shape}: expected the token ids' shape {tokens.shape}")
        pos = jnp.broadcast_to(pos, (B, T))
        _check_concrete(tokens, pos, self.config.vocab_size)
        ranks = self.layout.num_ranks if self.layout is not None else 1
        pad = -B % ranks  # rows are split over the attention ranks: padding rows make them divide
        if pad:
            tokens = jnp.concatenate([tokens, jnp.zeros((pad, T), jnp.int32)])
            pos = jnp.concatenate([pos, jnp.full((pad, T), -1, jnp.int32)])
        logits, records = _logits(
            self.to_params(),
            tokens,
            pos,
            cfg=self.config,
            kernels=self.kernels,
            layout=self.layout,
            inspect=model.Inspect(hidden_states=True) if intermediates else None,
        )
        logits = logits[:B]
        if records is not None:
            records = jax.tree.map(lambda a: a[:, :B], records)
            self.layers.sow(nnx.Intermediate, "hidden_states", records.hidden_states)
            self.layers.attn.sow(nnx.Intermediate, "sink_mass", records.sink_mass)
            for name in ("router_logits", "expert_ids", "expert_weights"):
                self.layers.mlp.sow(nnx.Intermediate, name, getattr(records, name))
        return logits[0] if single else logits


def _check_concrete(tokens_BT: jax.Array, positions_BT: jax.Array, vocab_size: int) -> None:
    """Out-of-range ids and positions would be clamped silently on device: refuse them where the values are known
    (not under a trace, e.g. inside `jax.grad`)."""
    if isinstance(tokens_BT, jax.core.Tracer) or isinstance(positions_BT, jax.core.Tracer):
        return
    bad = (tokens_BT < 0) | (tokens_BT >= vocab_size)
    if bad.any():
        raise ValueError(f"token id {int(tokens_BT[bad][0])} is outside the vocabulary [0, {vocab_size})")
    T = tokens_BT.shape[1]
    if ((positions_BT < -1) | (positions_BT >= T)).any():
        raise ValueError(f"positions must lie in [-1, {T}) (-1: padding; a row attends only to the tokens it holds)")


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "layout", "inspect"))
def _logits(params, tokens_BT, positions_BT, *, cfg: ModelConfig, kernels, layout, inspect):
    """`model.forward` and `model.unembed` on a fresh cache: rank `r`'s rows own its pages (null page first), row
    `i` of a rank the consecutive pages `1 + i * M ...`, in both pools."""
    B, T = tokens_BT.shape
    ranks = layout.num_ranks if layout is not None else 1
    rows, M = B // ranks, math.ceil(T / PAGE_SIZE)
    pages = rows * M + 1
    cache = model.PagedKVCache.zeros(cfg, ranks * pages, ranks * pages, PAGE_SIZE, params.embed.dtype)
    if layout is not None:
        cache = jax.lax.with_sharding_constraint(cache, layout.cache_sharding(cfg.num_kv_heads))
    local = jnp.arange(B, dtype=jnp.int32) % rows
    table = 1 + local[:, None] * M + jnp.arange(M, dtype=jnp.int32)
    tables = model.PageTables(table, table, jnp.zeros((B,), jnp.int32))
    x, _, records = model.forward(params, cache, tokens_BT, positions_BT, tables, cfg, kernels, inspect, layout)
    return model.unembed(params, x), records
