"""Model configuration: one frozen dataclass, read from any of the three published config layouts.

gpt-oss configs exist as the Hugging Face `config.json` (RoPE as `rope_scaling` + `rope_theta`), the
newer transformers-v5 `config.json` (`rope_parameters` with `rope_theta` inside) and OpenAI's
`original/config.json` (different key names, crossed ntk alpha/beta naming). Reading only one of the
RoPE layouts silently drops YaRN, so all three are handled here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

# The presets and profiles of the repository's configs/, shipped inside the package (gptoss_jax/configs links there).
PRESETS_DIR = Path(__file__).resolve().parent / "configs"


class ConfigError(ValueError):
    """A config file is missing a required key or has an invalid value."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    num_layers: int
    num_experts: int
    experts_per_token: int
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    head_dim: int
    num_heads: int
    num_kv_heads: int
    sliding_window: int
    rope_theta: float
    rope_factor: float
    rope_beta_fast: float
    rope_beta_slow: float
    rope_original_max_pos: int
    rope_truncate: bool = False
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    eos_token_ids: tuple[int, ...] = (200002, 200012)
    pad_token_id: int = 199999

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        if self.experts_per_token > self.num_experts:
            raise ConfigError(f"experts_per_token={self.experts_per_token} exceeds num_experts={self.num_experts}")
        for name in ("hidden_size", "intermediate_size"):
            if getattr(self, name) % 32:
                raise ConfigError(f"{name}={getattr(self, name)} must be a multiple of 32 (MXFP4 block)")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even (half-split RoPE)")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def is_sliding(self, layer: int) -> bool:
        """Even layers (0, 2, ...) use the 128-key sliding window; odd layers attend fully."""
        return layer % 2 == 0

    @property
    def rope_concentration(self) -> float:
        """YaRN attention factor, applied to both cos and sin (so q.k scales by its square)."""
        return 0.1 * math.log(self.rope_factor) + 1.0 if self.rope_factor > 1 else 1.0

    @property
    def param_count(self) -> int:
        h, i, e, v = self.hidden_size, self.intermediate_size, self.num_experts, self.vocab_size
        qkv = h * self.head_dim * (self.num_heads + 2 * self.num_kv_heads)
        attn = qkv + self.head_dim * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * self.head_dim * h + h
        moe = e * h + e + e * (h * 2 * i + 2 * i + i * h + h)
        return self.num_layers * (attn + moe + self.num_heads + 2 * h) + 2 * v * h + h


_REQUIRED_HF = {
    "num_layers": "num_hidden_layers",
    "num_experts": "num_local_experts",
    "experts_per_token": "num_experts_per_tok",
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "sliding_window": "sliding_window",
}

_REQUIRED_ORIGINAL = {
    "num_layers": "num_hidden_layers",
    "num_experts": "num_experts",
    "experts_per_token": "experts_per_token",
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "sliding_window": "sliding_window",
    "head_dim": "head_dim",
    "rope_theta": "rope_theta",
}


def _require(raw: dict[str, Any], key: str, source: str) -> Any:
    if key not in raw:
        raise ConfigError(f"{source}: missing required key '{key}'")
    return raw[key]


def _eos_ids(raw: dict[str, Any], source: str) -> tuple[int, ...]:
    # config.json lists only <|return|>; chat generation must also stop on <|call|>. Hugging Face allows null.
    eos = raw.get("eos_token_id", 200002)
    ids = [i for i in (eos if isinstance(eos, list) else [eos]) if i is not None]
    if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids):
        raise ConfigError(f"{source}: eos_token_id={eos!r} must be a token id, a list of them, or null")
    for stop in (200002, 200012):
        if stop < raw.get("vocab_size", 0) and stop not in ids:
            ids.append(stop)
    return tuple(int(i) for i in ids)


def from_hf_dict(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Hugging Face `config.json`, with RoPE in `rope_scaling`+`rope_theta` or in `rope_parameters`."""
    fields = {ours: _require(raw, theirs, source) for ours, theirs in _REQUIRED_HF.items()}
    h, nq = fields["hidden_size"], fields["num_heads"]
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{source}: 'rope_scaling'/'rope_parameters' must be an object, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "yarn" if rope else "default"))
    if rope_type not in ("yarn", "default"):
        raise ConfigError(f"{source}: unsupported rope_type '{rope_type}' (gpt-oss uses 'yarn')")
    theta = rope.get("rope_theta", raw.get("rope_theta"))
    if theta is None:
        raise ConfigError(f"{source}: missing required key 'rope_theta' (top level or in rope_parameters)")
    original_max = rope.get("original_max_position_embeddings", raw.get("initial_context_length", 4096))
    if rope_type == "yarn":
        factor = float(_require(rope, "factor", f"{source} rope_scaling"))
    else:
        factor = 1.0
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        expected = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(len(layer_types))]
        if list(layer_types) != expected:
            raise ConfigError(
                f"{source}: layer_types {layer_types} differ from gpt-oss's alternating "
                "sliding/full pattern starting with sliding at layer 0"
            )
    return ModelConfig(
        **fields,
        head_dim=int(raw.get("head_dim", h // nq)),
        rope_theta=float(theta),
        rope_factor=factor,
        rope_beta_fast=float(rope.get("beta_fast", 32.0)),
        rope_beta_slow=float(rope.get("beta_slow", 1.0)),
        rope_original_max_pos=int(original_max),
        rope_truncate=bool(rope.get("truncate", False)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=int(raw.get("max_position_embeddings", original_max * factor)),
        eos_token_ids=_eos_ids(raw, source),
        pad_token_id=int(raw.get("pad_token_id") if raw.get("pad_token_id") is not None else 199999),
    )


def from_original_dict(raw: dict[str, Any], source: str = "original/config.json") -> ModelConfig:
    """OpenAI's reference `original/config.json`. Note ntk_beta -> beta_fast, ntk_alpha -> beta_slow."""
    fields = {ours: _require(raw, theirs, source) for ours, theirs in _REQUIRED_ORIGINAL.items()}
    initial = int(raw.get("initial_context_length", 4096))
    factor = float(raw.get("rope_scaling_factor", 1.0))
    return ModelConfig(
        **fields,
        rope_factor=factor,
        rope_beta_fast=float(raw.get("rope_ntk_beta", 32.0)),
        rope_beta_slow=float(raw.get("rope_ntk_alpha", 1.0)),
        rope_original_max_pos=initial,
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
        max_position_embeddings=int(initial * factor),
        eos_token_ids=_eos_ids(raw, source),
    )


def load_config(path: str | Path) -> ModelConfig:
    """Config from a checkpoint folder (HF `config.json`, else `original/config.json`) or a json file."""
    path = Path(path)
    if path.is_dir():
        for candidate, reader in (
            (path / "config.json", from_hf_dict),
            (path / "original" / "config.json", from_original_dict),
        ):
            if candidate.exists():
                return reader(_read_json(candidate), str(candidate))
        raise ConfigError(f"{path}: no config.json or original/config.json found")
    raw = _read_json(path)
    reader = from_hf_dict if "num_local_experts" in raw or "model_type" in raw else from_original_dict
    return reader(raw, str(path))


def preset(name: str) -> ModelConfig:
    """Built-in config by name: 'gpt-oss-20b' or 'gpt-oss-120b'."""
    file = PRESETS_DIR / f"{name}.json"
    if not file.exists():
        known = sorted(p.stem for p in PRESETS_DIR.glob("*.json"))
        raise ConfigError(f"unknown preset '{name}'; known presets: {known}")
    return from_hf_dict(_read_json(file), str(file))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"{path}: file not found")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object at top level")
    return raw
