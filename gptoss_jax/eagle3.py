"""EAGLE-3 drafters for gpt-oss: config, weights and forward of the published `LlamaForCausalLMEagle3` layout.

A drafter is one Llama decoder layer that reads the target's residual stream at a few layers (`aux_layer_ids`,
numbered as vLLM numbers them: the stream entering layer i) fused by `fc`, next to the embedding of the next token;
it predicts over its own (usually smaller) vocabulary, mapped to the target's by the `d2t` offsets. Each draft step
feeds its own pre-norm output back in as the next step's hidden state. docs/speculative.md says where every piece
of the layout comes from and how the engine runs `propose` inside its decode loop.

The drafter keeps its own K/V in one extra one-layer paged pool (`DraftKV`) indexed by the target's full-layer page
tables (`Pages`): position p of a sequence lives in page `table[p // page_size]`, slot `p % page_size`, like the
target's full layers. So prefix caching, preemption and page reuse need nothing of their own: a shared prefix page
holds the drafter's K/V beside the target's, and a freed page's entries are rewritten by its next owner. Rollback is
free: a call reads the pool only before its first position and its own rows (and its earlier draft steps') after it,
and every accepted position is rewritten from the target's hidden states by the next `propose`, so rejected drafts
are overwritten before they are read. Draft steps past the first pass never write the pool (they ride along in the
call), so drafting never writes a page the target did not.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from gptoss_jax.checkpoint import CheckpointError, find_files, resolve_model
from gptoss_jax.config import ConfigError, ModelConfig
from gptoss_jax.safetensors_io import Reader
from pallas_kernels import rope

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "EAGLE3LlamaForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


# ---- config ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """A drafter's `config.json`, checked against its target. Field names follow `ModelConfig` where they mean the
    same (the RoPE fields are the ones `pallas_kernels.rope.inv_freq` reads)."""

    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's; the embedding's rows
    draft_vocab_size: int  # the lm_head's rows
    aux_layer_ids: tuple[int, ...]  # the target's stream entering these layers (vLLM's numbering), in fc order
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    norm_before_fc: bool = False  # RMSNorm over the concatenated aux states before fc (`input_norm.weight`)
    norm_before_residual: bool = False  # the layer's residual is hidden_norm(h), not h
    norm_output: bool = False  # the next step reads the final-normed hidden state, not the pre-norm one
    rope_type: str = "default"
    rope_theta: float = 10000.0
    rope_factor: float = 1.0
    rope_original_max_pos: int = 8192
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_beta_fast: float = 32.0  # yarn
    rope_beta_slow: float = 1.0  # yarn
    rope_truncate: bool = True  # yarn (Hugging Face's default; gpt-oss itself sets False)
    rope_attention_factor: float | None = None  # yarn: scale on cos and sin; None: 0.1 ln(factor) + 1

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def rope_concentration(self) -> float:
        if self.rope_type != "yarn":
            return 1.0
        if self.rope_attention_factor is not None:
            return self.rope_attention_factor
        return 0.1 * math.log(self.rope_factor) + 1.0 if self.rope_factor > 1 else 1.0


def _get(raw: dict, key: str, source: str, kind=int, default=None, required: bool = False):
    if key not in raw or raw[key] is None:
        if required:
            raise ConfigError(f"{source}: missing required field '{key}'")
        return default
    value = raw[key]
    ok = isinstance(value, bool) if kind is bool else isinstance(value, (int, float) if kind is float else kind)
    if not ok or (kind is not bool and isinstance(value, bool)):
        raise ConfigError(f"{source}: field '{key}' must be {kind.__name__}, got {value!r}")
    return kind(value)


def from_hf_dict(raw: dict, target: ModelConfig, source: str = "config.json") -> Eagle3Config:
    """The drafter config of a published `config.json` dict, for the target `target`."""
    archs = raw.get("architectures") or []
    if not any(a in ARCHITECTURES for a in archs):
        hint = " (the speculators layout: not supported)" if "Eagle3Speculator" in archs else ""
        raise ConfigError(
            f"{source}: field 'architectures' is {archs}{hint}; an EAGLE-3 drafter has one of {ARCHITECTURES}"
        )
    eagle = raw.get("eagle_config") or {}
    if not isinstance(eagle, dict):
        raise ConfigError(f"{source}: field 'eagle_config' must be an object, got {eagle!r}")

    def flag(key: str) -> bool:  # eagle_config first (NVIDIA's checkpoints), then the top level (speculators')
        return bool(eagle.get(key, raw.get(key, False)))

    if not eagle.get("use_aux_hidden_state", True):
        raise ConfigError(f"{source}: eagle_config.use_aux_hidden_state is false (EAGLE-1 style): not supported")
    for key in ("fc_norm", "eh_proj_before_attn"):
        if flag(key):
            raise ConfigError(f"{source}: field '{key}' is set; this EAGLE-3 variant is not supported")
    layers = _get(raw, "num_hidden_layers", source, default=1)
    if layers != 1:
        raise ConfigError(f"{source}: field 'num_hidden_layers' is {layers}; only one-layer drafters are supported")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{source}: field 'hidden_act' is {act!r}; the drafter's MLP is SiLU-gated")
    if raw.get("mlp_bias"):
        raise ConfigError(f"{source}: field 'mlp_bias' is true; the drafter's MLP has no biases")
    if raw.get("tie_word_embeddings"):
        raise ConfigError(f"{source}: field 'tie_word_embeddings' is true; the drafter's lm_head is its own")

    hidden = _get(raw, "hidden_size", source, required=True)
    heads = _get(raw, "num_attention_heads", source, required=True)
    target_hidden = _get(raw, "target_hidden_size", source, default=hidden)
    if target_hidden != target.hidden_size:
        field = "target_hidden_size" if "target_hidden_size" in raw else "hidden_size"
        raise ConfigError(
            f"{source}: field '{field}' is {target_hidden}, but the target's hidden_size is {target.hidden_size}"
        )
    vocab = _get(raw, "vocab_size", source, required=True)
    if vocab != target.vocab_size:
        raise ConfigError(f"{source}: field 'vocab_size' is {vocab}, but the target's is {target.vocab_size}")
    draft_vocab = _get(raw, "draft_vocab_size", source, default=vocab)
    if not 0 < draft_vocab <= vocab:
        raise ConfigError(f"{source}: field 'draft_vocab_size' is {draft_vocab}; it must lie in 1..{vocab}")

    kv_heads = _get(raw, "num_key_value_heads", source, default=heads)
    head_dim = _get(raw, "head_dim", source, default=hidden // heads)
    if heads % kv_heads or head_dim % 2:
        raise ConfigError(
            f"{source}: num_attention_heads={heads} must be a multiple of num_key_value_heads={kv_heads} and "
            f"head_dim={head_dim} even (half-split RoPE)"
        )

    L = target.num_layers
    ids = eagle.get("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"))
    given = ids is not None
    if not given:
        ids = [2, L // 2, L - 3]  # vLLM's default for gpt-oss
    if (
        not isinstance(ids, list)
        or not ids
        or any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i <= L for i in ids)
        or len(set(ids)) != len(ids)
    ):
        what = f"is {ids!r}" if given else f"is absent and vLLM's default {ids} does not fit"
        raise ConfigError(
            f"{source}: field 'eagle_aux_hidden_state_layer_ids' {what}; it must list distinct target layers "
            f"in 0..{L} (the stream entering layer i; the target has {L} layers)"
        )

    rope_raw = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope_raw, dict):
        raise ConfigError(f"{source}: field 'rope_scaling' must be an object or null, got {rope_raw!r}")
    rope_src = f"{source} rope_scaling"
    rope_type = rope_raw.get("rope_type", rope_raw.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{source}: rope_type {rope_type!r} is not supported (one of {ROPE_TYPES})")
    theta = _get(rope_raw, "rope_theta", rope_src, float) or _get(raw, "rope_theta", source, float, 10000.0)
    rope_fields = {}
    if rope_type != "default":
        rope_fields["rope_factor"] = _get(rope_raw, "factor", rope_src, float, required=True)
        original = rope_raw.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        rope_fields["rope_original_max_pos"] = int(original)
    if rope_type == "llama3":
        rope_fields["rope_low_freq_factor"] = _get(rope_raw, "low_freq_factor", rope_src, float, 1.0)
        rope_fields["rope_high_freq_factor"] = _get(rope_raw, "high_freq_factor", rope_src, float, 4.0)
    if rope_type == "yarn":
        rope_fields["rope_beta_fast"] = _get(rope_raw, "beta_fast", rope_src, float, 32.0)
        rope_fields["rope_beta_slow"] = _get(rope_raw, "beta_slow", rope_src, float, 1.0)
        rope_fields["rope_truncate"] = _get(rope_raw, "truncate", rope_src, bool, True)
        rope_fields["rope_attention_factor"] = _get(rope_raw, "attention_factor", rope_src, float)
    return Eagle3Config(
        hidden_size=hidden,
        target_hidden_size=target_hidden,
        intermediate_size=_get(raw, "intermediate_size", source, required=True),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        aux_layer_ids=tuple(ids),
        rms_norm_eps=_get(raw, "rms_norm_eps", source, float, 1e-6),
        attention_bias=bool(raw.get("attention_bias", False)),
        norm_before_fc=flag("norm_before_fc"),
        norm_before_residual=flag("norm_before_residual"),
        norm_output=flag("norm_output") or flag("return_hidden_post_norm"),
        rope_type=rope_type,
        rope_theta=theta,
        **rope_fields,
    )


def load_config(path: str | os.PathLike, target: ModelConfig) -> Eagle3Config:
    """The config of a drafter folder (its `config.json`) or of a json file."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise ConfigError(f"{file}: file not found (an EAGLE-3 drafter folder holds config.json)")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: invalid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: expected a JSON object at top level")
    return from_hf_dict(raw, target, str(file))


# ---- weights -----------------------------------------------------------------------------------------------------


@struct.dataclass
class DrafterParams:
    """The drafter's weights in Hugging Face's `[out, in]` orientation. `embed` is the drafter's own
    `embed_tokens` or, when the checkpoint has none, the target's embedding (shared, not copied). `d2t[i]` is the
    offset from draft id i to its target id (`i + d2t[i]`)."""

    embed: jax.Array  # [V, H]
    fc: jax.Array | None  # [H, A * Ht]; None for a one-aux-state drafter as wide as its target (no fc)
    input_norm: jax.Array | None  # [A * Ht] with norm_before_fc
    attn_norm: jax.Array  # [H] midlayer.input_layernorm (on the embedding)
    hidden_norm: jax.Array  # [H] (on the fused hidden state)
    q_w: jax.Array  # [N * hd, 2H]
    k_w: jax.Array  # [K * hd, 2H]
    v_w: jax.Array  # [K * hd, 2H]
    o_w: jax.Array  # [H, N * hd]
    q_b: jax.Array | None
    k_b: jax.Array | None
    v_b: jax.Array | None
    o_b: jax.Array | None
    mlp_norm: jax.Array  # [H] midlayer.post_attention_layernorm
    gate_w: jax.Array  # [I, H]
    up_w: jax.Array  # [I, H]
    down_w: jax.Array  # [H, I]
    final_norm: jax.Array  # [H]
    lm_head: jax.Array  # [Vd, H]
    d2t: jax.Array  # i32 [Vd]


def tensor_specs(cfg: Eagle3Config) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Canonical file tensor name -> (DrafterParams field, shape) of the published layout (SpecForge's names:
    `midlayer.*` at the top level). `embed_tokens.weight` is optional, `d2t` required when the vocabularies
    differ; `t2d` (a bool mask over the target vocabulary) is read by nobody."""
    H, I, A, Ht = cfg.hidden_size, cfg.intermediate_size, cfg.num_aux, cfg.target_hidden_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    specs = {
        "embed_tokens.weight": ("embed", (cfg.vocab_size, H)),
        "fc.weight": ("fc", (H, A * Ht)),
        "midlayer.input_layernorm.weight": ("attn_norm", (H,)),
        "midlayer.hidden_norm.weight": ("hidden_norm", (H,)),
        "midlayer.self_attn.q_proj.weight": ("q_w", (q, 2 * H)),
        "midlayer.self_attn.k_proj.weight": ("k_w", (kv, 2 * H)),
        "midlayer.self_attn.v_proj.weight": ("v_w", (kv, 2 * H)),
        "midlayer.self_attn.o_proj.weight": ("o_w", (H, q)),
        "midlayer.post_attention_layernorm.weight": ("mlp_norm", (H,)),
        "midlayer.mlp.gate_proj.weight": ("gate_w", (I, H)),
        "midlayer.mlp.up_proj.weight": ("up_w", (I, H)),
        "midlayer.mlp.down_proj.weight": ("down_w", (H, I)),
        "norm.weight": ("final_norm", (H,)),
        "lm_head.weight": ("lm_head", (cfg.draft_vocab_size, H)),
        "d2t": ("d2t", (cfg.draft_vocab_size,)),
        "t2d": ("", (cfg.vocab_size,)),
    }
    if cfg.norm_before_fc:
        specs["input_norm.weight"] = ("input_norm", (A * Ht,))
    if cfg.attention_bias:
        for n, size in (("q", q), ("k", kv), ("v", kv), ("o", H)):
            specs[f"midlayer.self_attn.{n}_proj.bias"] = (f"{n}_b", (size,))
    return specs


OPTIONAL = {"embed_tokens.weight", "d2t", "t2d"}


def canonical_name(name: str) -> str:
    """Published drafters spell the same tensor several ways: with a `model.` prefix (vLLM's own export) and
    `layers.0.` for `midlayer.` (TensorRT-LLM and speculators)."""
    if name.startswith("model."):
        name = name[len("model.") :]
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0.") :]
    return name


def _check_dtype(file, name: str, dtype: str, field: str) -> None:
    want = {"d2t": ("I64", "I32"), "": ("BOOL", "U8")}.get(field, ("BF16", "F16", "F32"))
    if dtype not in want:
        raise CheckpointError(f"{file}: tensor '{name}' has dtype {dtype}, expected one of {list(want)}")


def load(
    model: str | os.PathLike,
    target: ModelConfig,
    dtype=jnp.bfloat16,
    *,
    target_embed: jax.Array | None = None,
    revision: str | None = None,
    download_dir=None,
) -> tuple[Eagle3Config, DrafterParams]:
    """A drafter from a local folder or a Hugging Face repo id (`checkpoint.resolve_model`), for `target`. Float
    weights come out in `dtype`. Without `embed_tokens.weight` in the files the drafter shares `target_embed` (the
    target's `params.embed`), which then must be given. Every missing, unexpected or misshapen tensor is an error
    naming it and its file."""
    path = resolve_model(model, revision=revision, download_dir=download_dir)
    cfg = load_config(path, target)
    return cfg, load_weights(path, cfg, dtype, target_embed=target_embed)


def load_weights(path: Path, cfg: Eagle3Config, dtype, *, target_embed: jax.Array | None = None) -> DrafterParams:
    """The weights of the drafter folder `path` whose config is `cfg` (see `load`)."""
    path = Path(path)
    _, files = find_files(path)
    specs = tensor_specs(cfg)
    found: dict[str, tuple[Path, Reader, str]] = {}
    unexpected = []
    for file in files:
        reader = Reader(file)
        for name in reader.names():
            key = canonical_name(name)
            if key not in specs:
                unexpected.append(f"{name} {list(reader.shape(name))} in {file.name}")
                continue
            if key in found:
                raise CheckpointError(f"{file}: tensor '{name}' also appears in {found[key][0]}")
            field, shape = specs[key]
            _check_dtype(file, name, reader.dtype_name(name), field)
            if reader.shape(name) != shape:
                raise CheckpointError(
                    f"{file}: tensor '{name}' has shape {list(reader.shape(name))}, expected {list(shape)}"
                )
            found[key] = (file, reader, name)
    if unexpected:
        raise CheckpointError(
            f"{path}: {len(unexpected)} tensor(s) not in the EAGLE-3 layout this loader reads, e.g. {unexpected[:5]}"
        )
    needed = set(specs) - OPTIONAL | ({"d2t"} if cfg.draft_vocab_size != cfg.vocab_size else set())
    if cfg.num_aux == 1 and cfg.target_hidden_size == cfg.hidden_size:  # one aux state passes straight through
        needed.discard("fc.weight")
    missing = sorted(needed - set(found))
    if missing:
        shapes = [f"{n} {list(specs[n][1])}" for n in missing]
        raise CheckpointError(
            f"{path}: missing {len(missing)} tensor(s): {shapes} (searched {[f.name for f in files]})"
        )

    def read(key: str) -> np.ndarray:
        file, reader, name = found[key]
        return np.asarray(reader.get(name))

    values: dict[str, jax.Array | None] = dict.fromkeys(f.name for f in dataclasses.fields(DrafterParams))
    for key, (field, _) in specs.items():
        if key in found and field and field != "d2t":
            values[field] = jnp.asarray(read(key), dtype)
    if "d2t" in found:
        d2t = read("d2t").astype(np.int64)
        ids = np.arange(cfg.draft_vocab_size) + d2t
        if ids.min() < 0 or ids.max() >= cfg.vocab_size or len(np.unique(ids)) != len(ids):
            raise CheckpointError(
                f"{found['d2t'][0]}: tensor 'd2t' maps draft ids to target ids outside 0..{cfg.vocab_size - 1} "
                "or to one target id twice"
            )
        values["d2t"] = jnp.asarray(d2t, jnp.int32)
    else:
        values["d2t"] = jnp.zeros((cfg.draft_vocab_size,), jnp.int32)
    if values["embed"] is None:
        if target_embed is None:
            raise CheckpointError(
                f"{path}: no 'embed_tokens.weight'; this drafter shares the target's embedding (pass target_embed)"
            )
        if tuple(target_embed.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise CheckpointError(
                f"{path}: no 'embed_tokens.weight', and the target's embedding {list(target_embed.shape)} does not "
                f"fit the drafter's [{cfg.vocab_size}, {cfg.hidden_size}]"
            )
        values["embed"] = target_embed
    return DrafterParams(**values)


# ---- forward -----------------------------------------------------------------------------------------------------


@struct.dataclass
class DraftKV:
    """The drafter's K/V: one layer's page pool `[P, S, K, hd]`, its page ids the target's full-layer ones (see the
    module docstring)."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, cfg: Eagle3Config, num_pages: int, page_size: int, dtype) -> "DraftKV":
        shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @property
    def page_size(self) -> int:
        return self.k.shape[1]


@struct.dataclass
class Pages:
    """Where a call's sequences keep their K/V in a `DraftKV`: the target's full-layer page tables `[B, M]`, and per
    row the positions below which pages are shared prefix-cache pages (already holding the drafter's K/V: not
    rewritten)."""

    table_BM: jax.Array  # i32
    cached_B: jax.Array  # i32


def _write(kv: DraftKV, pages: Pages, positions_BT, k_BTKH, v_BTKH) -> DraftKV:
    """Rows' K/V at their positions; padding rows (-1) and prefix-cached positions write nothing."""
    S, M = kv.page_size, pages.table_BM.shape[1]
    page = jnp.take_along_axis(pages.table_BM, jnp.clip(positions_BT // S, 0, M - 1), axis=1)
    keep = (positions_BT >= 0) & (positions_BT >= pages.cached_B[:, None])
    at = (jnp.where(keep, page, kv.k.shape[0]), jnp.maximum(positions_BT, 0) % S)  # out of range: dropped
    return DraftKV(kv.k.at[at].set(k_BTKH, mode="drop"), kv.v.at[at].set(v_BTKH, mode="drop"))


@struct.dataclass
class StepOutput:
    logits: jax.Array  # f32 [B, T, Vd] over the draft vocabulary
    hidden: jax.Array  # [B, T, H] what the next draft step reads as its hidden state
    kv: DraftKV
    k: jax.Array  # [B, T, K, hd] the rows' own keys and values (a draft step's, for the steps after it)
    v: jax.Array


@struct.dataclass
class Proposal:
    tokens: jax.Array  # i32 [B, k] target-vocabulary draft tokens
    draft_ids: jax.Array  # i32 [B, k] the same in the draft vocabulary
    probs: jax.Array  # f32 [B, k, Vd] the distribution each was drawn from (one-hot for greedy rows)
    kv: DraftKV


def _norm(x, gain, eps, dtype):
    """Llama's RMSNorm: normalise in fp32, cast, then scale (gpt-oss scales before the cast)."""
    t = x.astype(jnp.float32)
    t = t * jax.lax.rsqrt(jnp.mean(t * t, axis=-1, keepdims=True) + eps)
    return t.astype(dtype) * gain.astype(dtype)


def _linear(x, w, b=None):
    y = jnp.einsum("...i,oi->...o", x, w, preferred_element_type=jnp.float32)
    return y if b is None else y + b.astype(jnp.float32)


def inv_freq(cfg: Eagle3Config) -> np.ndarray:
    """Per-pair inverse frequencies `[head_dim/2]` of the drafter's RoPE (Hugging Face's rope types)."""
    base = 1.0 / cfg.rope_theta ** (np.arange(cfg.head_dim // 2, dtype=np.float64) * 2 / cfg.head_dim)
    if cfg.rope_type == "linear":
        return base / cfg.rope_factor
    if cfg.rope_type == "yarn":
        return rope.inv_freq(cfg)
    if cfg.rope_type == "llama3":
        wavelen = 2 * math.pi / base
        low, high = (
            cfg.rope_original_max_pos / cfg.rope_low_freq_factor,
            cfg.rope_original_max_pos / cfg.rope_high_freq_factor,
        )
        smooth = (cfg.rope_original_max_pos / wavelen - cfg.rope_low_freq_factor) / (
            cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
        )
        mid = (1 - smooth) * base / cfg.rope_factor + smooth * base
        return np.where(wavelen > low, base / cfg.rope_factor, np.where(wavelen < high, base, mid))
    return base


def fuse(params: DrafterParams, cfg: Eagle3Config, aux_ABTX: jax.Array) -> jax.Array:
    """The target's aux hidden states `[A, B, T, Ht]` (`model.forward(..., aux_layers=cfg.aux_layer_ids)`) to the
    drafter's hidden state `[B, T, H]`: concatenated in id order, normed when `norm_before_fc`, through `fc` (a
    drafter of one aux state may have none: TensorRT-LLM's layout for NVIDIA's -throughput drafter)."""
    dtype = params.q_w.dtype
    A, B, T, Ht = aux_ABTX.shape
    with jax.named_scope(f"eagle3_fuse_{A}x{Ht}"):
        x = jnp.moveaxis(aux_ABTX, 0, 2).reshape(B, T, A * Ht)
        if cfg.norm_before_fc:
            x = _norm(x, params.input_norm, cfg.rms_norm_eps, dtype)
        return x.astype(dtype) if params.fc is None else _linear(x.astype(dtype), params.fc).astype(dtype)


def _attention(params, cfg, kv: DraftKV, x_BTE, positions_BT, pages: Pages, recent) -> tuple[jax.Array, ...]:
    """Causal attention of the new rows over the pool before the call's first position, `recent` (earlier draft
    steps' rows `(k, v, positions)` of this call, or None) and each other. -> (output, the rows' k, v)."""
    dtype = params.q_w.dtype
    B, T, _ = x_BTE.shape
    N, K, hd, S = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, kv.page_size
    q = _linear(x_BTE, params.q_w, params.q_b).astype(dtype).reshape(B, T, N, hd)
    k = _linear(x_BTE, params.k_w, params.k_b).astype(dtype).reshape(B, T, K, hd)
    v = _linear(x_BTE, params.v_w, params.v_b).astype(dtype).reshape(B, T, K, hd)
    angle = jnp.maximum(positions_BT, 0).astype(jnp.float32)[..., None] * jnp.asarray(inv_freq(cfg), jnp.float32)
    c = jnp.float32(cfg.rope_concentration)
    cos, sin = (jnp.cos(angle) * c).astype(dtype), (jnp.sin(angle) * c).astype(dtype)
    q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    # Keys: the pool's pages before the first position of the call and `recent` (what lies at or after it is stale
    # or this call's own), then `recent`, then the call's own rows.
    new_pos = positions_BT if recent is None else jnp.concatenate([recent[2], positions_BT], 1)
    first = jnp.min(jnp.where(new_pos >= 0, new_pos, jnp.iinfo(jnp.int32).max), axis=1)
    M = pages.table_BM.shape[1]
    stored = jnp.broadcast_to(jnp.arange(M * S, dtype=jnp.int32), (B, M * S))
    parts = [
        (
            kv.k[pages.table_BM].reshape(B, M * S, K, hd),
            kv.v[pages.table_BM].reshape(B, M * S, K, hd),
            jnp.where(stored < first[:, None], stored, -1),
        ),
        *([recent] if recent is not None else []),
        (k, v, positions_BT),
    ]
    keys, values, held = (jnp.concatenate(a, 1) for a in zip(*parts))
    qg = q.reshape(B, T, K, N // K, hd)
    s = jnp.einsum("btkgh,bwkh->btkgw", qg, keys.astype(dtype), preferred_element_type=jnp.float32) / math.sqrt(hd)
    p_BT, h_BW = positions_BT[:, :, None], held[:, None, :]
    visible = (h_BW >= 0) & (h_BW <= p_BT)  # [B, T, W]
    s = jnp.where(visible[:, :, None, None, :], s, -jnp.inf)
    w = jax.nn.softmax(jnp.where(visible.any(-1)[:, :, None, None, None], s, 0.0), axis=-1)
    o = jnp.einsum("btkgw,bwkh->btkgh", w.astype(dtype), values.astype(dtype), preferred_element_type=jnp.float32)
    return _linear(o.astype(dtype).reshape(B, T, N * hd), params.o_w, params.o_b), k, v


def step(
    params: DrafterParams,
    cfg: Eagle3Config,
    kv: DraftKV,
    tokens_BT: jax.Array,
    hidden_BTH: jax.Array,
    positions_BT: jax.Array,
    pages: Pages,
    recent: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    write: bool = True,
) -> StepOutput:
    """One pass of the drafter's layer over `T` rows per sequence. Row (b, t) pairs the hidden state at position
    `positions_BT[b, t]` (-1: padding) with the target-vocabulary token that follows it, `tokens_BT[b, t]`, and
    predicts the token after that one. Sequence b's K/V live in `kv` at its `pages`; `write` (static) stores the
    rows' K/V there, `recent` adds rows of earlier draft steps (see `_attention`)."""
    dtype = params.q_w.dtype
    eps = cfg.rms_norm_eps
    B, T, H = hidden_BTH.shape
    with jax.named_scope(f"eagle3_layer_{B}x{T}x{H}"):
        e = _norm(params.embed[tokens_BT], params.attn_norm, eps, dtype)
        h = hidden_BTH.astype(dtype)
        normed = _norm(h, params.hidden_norm, eps, dtype)
        residual = (normed if cfg.norm_before_residual else h).astype(jnp.float32)
        with jax.named_scope("attention"):
            y, k, v = _attention(params, cfg, kv, jnp.concatenate([e, normed], -1), positions_BT, pages, recent)
            if write:
                kv = _write(kv, pages, positions_BT, k, v)
        x = (y + residual).astype(dtype)
        with jax.named_scope("mlp"):
            m = _norm(x, params.mlp_norm, eps, dtype)
            g = jax.nn.silu(_linear(m, params.gate_w)).astype(dtype) * _linear(m, params.up_w).astype(dtype)
            x = (_linear(g, params.down_w) + x.astype(jnp.float32)).astype(dtype)
        out = _norm(x, params.final_norm, eps, dtype)
    with jax.named_scope(f"eagle3_lm_head_{cfg.draft_vocab_size}"):
        logits = _linear(out, params.lm_head)
    return StepOutput(logits, out if cfg.norm_output else x, kv, k, v)


def to_target(params: DrafterParams, draft_ids: jax.Array) -> jax.Array:
    """Draft-vocabulary ids to the target's (`i + d2t[i]`)."""
    return draft_ids + params.d2t[draft_ids]


def to_target_vocab(params: DrafterParams, probs_Vd: jax.Array, vocab_size: int) -> jax.Array:
    """Draft-vocabulary probabilities `[..., Vd]` as target-vocabulary ones `[..., V]` (zero outside the map)."""
    ids = to_target(params, jnp.arange(probs_Vd.shape[-1]))
    return jnp.zeros((*probs_Vd.shape[:-1], vocab_size), probs_Vd.dtype).at[..., ids].set(probs_Vd)


def _draw(logits_BV, temperature_B, keys_B2):
    """A draft token per row and the distribution it came from: argmax with a one-hot for temperature 0, else a
    sample of softmax(logits / temperature) with the row's own key (raw key data `[B, 2]`)."""
    greedy = temperature_B <= 0
    scaled = logits_BV / jnp.where(greedy, 1.0, temperature_B)[:, None]
    best = jnp.argmax(logits_BV, -1)
    ids = jnp.where(greedy, best, jax.vmap(jax.random.categorical)(keys_B2, scaled))
    probs = jnp.where(greedy[:, None], jax.nn.one_hot(best, logits_BV.shape[-1]), jax.nn.softmax(scaled, -1))
    return ids.astype(jnp.int32), probs


def propose(
    params: DrafterParams,
    cfg: Eagle3Config,
    kv: DraftKV,
    tokens_BT: jax.Array,
    aux_ABTX: jax.Array,
    positions_BT: jax.Array,
    pages: Pages,
    temperature_B: jax.Array,
    keys_B2: jax.Array,
    *,
    num_tokens: int,
) -> Proposal:
    """`num_tokens` (static) draft tokens per sequence after a target step.

    Rows as in `step`: the target step's positions `positions_BT` (-1: padding), its aux hidden states `aux_ABTX`
    there, and `tokens_BT` the tokens now known to follow each of them (the accepted tokens shifted by one, the
    target's newly sampled token last). The first pass writes the drafter's K/V for all of them and drafts from
    the last valid row; each further step feeds back its own hidden state and drafted token one position later
    (their K/V stay in the call). Draft j of a sampled row draws with its key `keys_B2` (raw `[B, 2]`) folded with
    j, so rows do not depend on each other. Sequences with no valid row draft garbage and write nothing."""
    B, T = tokens_BT.shape
    with jax.named_scope(f"eagle3_propose_{B}x{T}_k{num_tokens}"):
        first = step(params, cfg, kv, tokens_BT, fuse(params, cfg, aux_ABTX), positions_BT, pages)
        last = jnp.argmax(positions_BT, axis=1)
        pick = lambda a: jnp.take_along_axis(a, last[:, None, None], axis=1)[:, 0]  # noqa: E731
        key_at = lambda j: jax.vmap(jax.random.fold_in, (0, None))(keys_B2, j)  # noqa: E731
        ids, probs = _draw(pick(first.logits), temperature_B, key_at(0))
        pos = jnp.max(positions_BT, axis=1)
        K, hd, n = cfg.num_kv_heads, cfg.head_dim, max(num_tokens - 1, 1)
        recent = (jnp.zeros((B, n, K, hd), first.k.dtype), jnp.zeros((B, n, K, hd), first.v.dtype))
        recent = (*recent, jnp.full((B, n), -1, jnp.int32))

        def more(carry, j):
            recent, ids, hidden, pos = carry
            pos = jnp.where(pos >= 0, pos + 1, -1)
            tok = to_target(params, ids)[:, None]
            out = step(params, cfg, first.kv, tok, hidden[:, None], pos[:, None], pages, recent, write=False)
            rk, rv, rp = recent
            recent = (rk.at[:, j - 1].set(out.k[:, 0]), rv.at[:, j - 1].set(out.v[:, 0]), rp.at[:, j - 1].set(pos))
            nxt, probs = _draw(out.logits[:, 0], temperature_B, key_at(j))
            return (recent, nxt, out.hidden[:, 0], pos), (nxt, probs)

        carry = (recent, ids, pick(first.hidden), pos)
        _, (rest, rest_probs) = jax.lax.scan(more, carry, jnp.arange(1, num_tokens))
    draft = jnp.concatenate([ids[:, None], rest.T], axis=1)
    q = jnp.concatenate([probs[:, None], jnp.moveaxis(rest_probs, 0, 1)], axis=1)
    return Proposal(to_target(params, draft), draft, q, first.kv)
