"""Random gpt-oss checkpoints in the exact published file layouts, for tests, the demo and benchmarks.

Values are drawn so the network behaves like a trained one numerically (unit-scale residual stream,
fan-in-scaled weights, MXFP4 codes with realistic per-block scales), and tensors are streamed to
disk one at a time, so even the 120b shape needs little host memory.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

import pallas_kernels
from gptoss_jax import checkpoint, eagle3, safetensors_io
from gptoss_jax.config import from_hf_dict, from_original_dict
from pallas_kernels import REFERENCE, KernelConfig
from pallas_kernels import params as params_lib

BF16 = np.dtype(ml_dtypes.bfloat16)

# A small model with the real vocabulary, so the demo server handles real text.
DEMO_CONFIG = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "num_hidden_layers": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "experts_per_token": 2,
    "vocab_size": 201088,
    "hidden_size": 64,
    "intermediate_size": 64,
    "head_dim": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "sliding_window": 128,
    "rope_theta": 150000,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 4096,
        "truncate": False,
    },
    "initial_context_length": 4096,
    "max_position_embeddings": 131072,
    "swiglu_limit": 7.0,
    "rms_norm_eps": 1e-05,
    "attention_bias": True,
    "tie_word_embeddings": False,
    "layer_types": ["sliding_attention", "full_attention"],
    "eos_token_id": 200002,
    "pad_token_id": 199999,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    },
}


def _tensor_specs(cfg, layout: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """File tensor name -> (shape, dtype) of every tensor the layout holds."""
    tree = params_lib.shapes(cfg)
    specs = {}
    for name, targets in checkpoint.tensor_targets(cfg, layout).items():
        t = targets[0]
        leaf = params_lib.get_field(tree, (("layers",) if t.layer is not None else ()) + t.field)
        shape = leaf.shape[1:] if t.layer is not None else leaf.shape
        if t.rows:
            shape = (targets[-1].rows[1],) + tuple(shape[1:])
        packed = t.field[-1] in checkpoint.PACKED_FIELDS
        specs[name] = (tuple(shape), np.dtype(np.uint8) if packed else BF16)
    return specs


def _draw(rng: np.random.Generator, name: str, shape, dtype, sink_scale: float) -> np.ndarray:
    if dtype == np.uint8:
        if name.endswith(("blocks", ".blocks")):
            return rng.integers(0, 256, size=shape, dtype=np.uint8)
        # Per-block E8M0 exponents around 1/(sqrt(fan_in) * rms(E2M1 code)), rms ~ 3.
        fan_in = shape[-1] * 32
        centre = 127 + round(math.log2(1.0 / (math.sqrt(fan_in) * 3.0)))
        return rng.integers(centre - 1, centre + 2, size=shape, dtype=np.uint8)
    if "norm" in name:
        x = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
    elif "sinks" in name:
        x = sink_scale * rng.standard_normal(shape, dtype=np.float32)
    elif name in ("model.embed_tokens.weight", "embedding.weight"):
        x = rng.standard_normal(shape, dtype=np.float32)
    elif len(shape) >= 2 and not name.endswith("bias"):
        x = rng.standard_normal(shape, dtype=np.float32) / np.float32(math.sqrt(shape[-1]))
    else:
        x = 0.1 * rng.standard_normal(shape, dtype=np.float32)
    return x.astype(dtype)


def write_checkpoint(
    path: str | Path,
    hf_config: dict,
    *,
    seed: int = 0,
    layout: str = "hf",
    max_shard_bytes: int = 4 << 30,
    sink_scale: float = 1.0,
    progress: bool = True,
) -> Path:
    """Write a random checkpoint for `hf_config` (a HF `config.json` dict) to folder `path`.

    `layout='hf'` writes `config.json` and `model.safetensors` (sharded with an index past
    `max_shard_bytes`); `layout='original'` writes OpenAI's `original/config.json` and
    `original/model.safetensors` (fused qkv, reference names).
    """
    path = Path(path)
    cfg = from_hf_dict(hf_config, "hf_config")
    folder = path if layout == "hf" else path / "original"
    folder.mkdir(parents=True, exist_ok=True)
    specs = _tensor_specs(cfg, layout)
    shards, current, size = [], {}, 0
    for name, spec in specs.items():
        nbytes = int(np.prod(spec[0])) * spec[1].itemsize
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = spec
        size += nbytes
    shards.append(current)
    rng = np.random.default_rng(seed)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    total = sum(int(np.prod(s[0])) * s[1].itemsize for s in specs.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"Writing {path.name}", disable=not progress) as bar:
        for fname, shard in zip(names, shards):

            def tensors(shard=shard):
                for name, (shape, dtype) in shard.items():
                    x = _draw(rng, name, shape, dtype, sink_scale)
                    bar.update(x.nbytes)
                    yield name, x

            safetensors_io.write(folder / fname, tensors(), shard, metadata={"format": "pt"})
    if len(shards) > 1:
        weight_map = {n: f for f, shard in zip(names, shards) for n in shard}
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
        )
    if layout == "hf":
        (folder / "config.json").write_text(json.dumps(hf_config, indent=2))
    else:
        (folder / "config.json").write_text(json.dumps(to_original_config(hf_config), indent=2))
        from_original_dict(to_original_config(hf_config))  # the written file must read back
    return path


def eagle3_config(target_hf: dict, **overrides) -> dict:
    """A `config.json` for an EAGLE-3 drafter of the target `target_hf` in the published layout (docs/speculative.md):
    the target's width and heads, an MLP six times as wide (17280 at gpt-oss's 2880), a draft vocabulary of
    32,000 ids or a quarter of a small target's, and vLLM's default aux layers (early/middle/late: 2, L/2, L-3;
    0, L/2, L below six layers). `overrides` replace any field."""
    L, V = target_hf["num_hidden_layers"], target_hf["vocab_size"]
    hidden = target_hf["hidden_size"]
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 6 * hidden,
        "num_attention_heads": target_hf["num_attention_heads"],
        "num_key_value_heads": target_hf["num_key_value_heads"],
        "head_dim": target_hf["head_dim"],
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "vocab_size": V,
        "draft_vocab_size": min(32000, V // 4),
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [2, L // 2, L - 3] if L >= 6 else [0, L // 2, L],
            "use_aux_hidden_state": True,
        },
    }
    cfg.update(overrides)
    return cfg


def write_eagle3_drafter(
    path: str | Path, drafter_hf: dict, target_hf: dict, *, seed: int = 0, embed: bool = True
) -> Path:
    """Write a random EAGLE-3 drafter for `drafter_hf` (e.g. `eagle3_config(target_hf)`) to folder `path`:
    `config.json` and one `model.safetensors` with the published tensor names (`fc.weight`, `midlayer.*`,
    `norm.weight`, `lm_head.weight`, int64 `d2t` offsets over a random sorted subset of the target vocabulary, bool
    `t2d`), and `embed_tokens.weight` unless `embed=False` (the drafter then shares the target's). Weights as
    `write_checkpoint` draws them: unit-scale embedding, fan-in-scaled matrices, norms near 1."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    cfg = eagle3.from_hf_dict(drafter_hf, from_hf_dict(target_hf, "target_hf"), "drafter_hf")  # must read back
    V, Vd = cfg.vocab_size, cfg.draft_vocab_size
    target_ids = np.sort(rng.choice(V, Vd, replace=False))
    specs, tensors = {}, {}
    for name, (field, shape) in eagle3.tensor_specs(cfg).items():
        if field == "embed" and not embed:
            continue
        if name == "d2t":
            x = (target_ids - np.arange(Vd)).astype(np.int64)
        elif name == "t2d":
            x = np.zeros(V, np.bool_)
            x[target_ids] = True
        elif "norm" in name:
            x = (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(BF16)
        elif field == "embed":
            x = rng.standard_normal(shape, dtype=np.float32).astype(BF16)
        elif name.endswith("bias"):
            x = (0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(BF16)
        else:
            x = (rng.standard_normal(shape, dtype=np.float32) / np.float32(math.sqrt(shape[-1]))).astype(BF16)
        specs[name], tensors[name] = (x.shape, x.dtype), x
    safetensors_io.write(path / "model.safetensors", tensors.items(), specs, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(drafter_hf, indent=2))
    return path


def to_original_config(hf: dict) -> dict:
    """The `original/config.json` equivalent of a HF config (crossed ntk naming included)."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    return {
        "num_hidden_layers": hf["num_hidden_layers"],
        "num_experts": hf["num_local_experts"],
        "experts_per_token": hf["num_experts_per_tok"],
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "intermediate_size": hf["intermediate_size"],
        "swiglu_limit": hf.get("swiglu_limit", 7.0),
        "head_dim": hf["head_dim"],
        "num_attention_heads": hf["num_attention_heads"],
        "num_key_value_heads": hf["num_key_value_heads"],
        "sliding_window": hf["sliding_window"],
        "initial_context_length": rope.get("original_max_position_embeddings", 4096),
        "rope_theta": rope.get("rope_theta", hf.get("rope_theta")),
        "rope_scaling_factor": rope.get("factor", 1.0),
        "rope_ntk_alpha": rope.get("beta_slow", 1.0),
        "rope_ntk_beta": rope.get("beta_fast", 32.0),
    }


def random_params(cfg, dtype=jnp.bfloat16, seed: int = 0, kernels: KernelConfig = REFERENCE):
    """Random `Params` at `cfg`'s shape drawn directly on device (no file): small normals, unit norms, MXFP4
    scales near 1/16. For benchmarks at the real shapes, where writing and reading a checkpoint is not the point.
    Experts come in the layout `kernels` read, drawn and converted one layer at a time, as the loader does."""
    shapes = params_lib.shapes(cfg, dtype)
    kernels = kernels.for_device()
    impl = kernels.impl
    tree = checkpoint.device_shapes(cfg, dtype, impl)
    paths = params_lib.field_paths(shapes)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(paths))
    make = jax.jit(_draw_device, static_argnums=(1, 2))
    for key, path in zip(keys, paths):
        s = params_lib.get_field(shapes, path)
        if path[:2] != ("layers", "experts"):
            tree = params_lib.with_field(tree, path, make(key, s, path[-1]))
            continue
        there = path[:2] + (pallas_kernels.expert_field(path[-1], impl),)
        want = params_lib.get_field(tree, there)
        buf, one = jnp.zeros(want.shape, want.dtype), jax.ShapeDtypeStruct(s.shape[1:], s.dtype)
        for layer in range(s.shape[0]):
            x = make(jax.random.fold_in(key, layer), one, path[-1])
            buf = params_lib.put_layer(buf, pallas_kernels.relayout_expert_field(path[-1], x, impl), layer)
        tree = params_lib.with_field(tree, there, buf)
    return pallas_kernels.prepare_params(tree, kernels)  # what else the kernels store (on Hopper)


def _draw_device(key, s, name: str):
    if s.dtype == jnp.uint8:
        if name.endswith("scales"):
            return jax.random.randint(key, s.shape, 118, 124, jnp.int32).astype(jnp.uint8)
        return jax.random.bits(key, s.shape, jnp.uint8)
    if name.endswith("norm"):
        return jnp.ones(s.shape, s.dtype)
    return (0.02 * jax.random.normal(key, s.shape, jnp.float32)).astype(s.dtype)
