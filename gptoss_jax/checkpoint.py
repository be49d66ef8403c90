"""Load gpt-oss checkpoints into `Params`: Hugging Face layout or OpenAI's `original/` layout.

Tensors stream from memory-mapped safetensors straight into preallocated device buffers (one tensor
in host memory at a time; layer slices written in place by a donated update). Expert weights stay
MXFP4-packed. Every mismatch is an error naming the tensor and the file. Converted parameters can be
saved with orbax so that a second start skips the conversion.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

import pallas_kernels
from gptoss_jax.config import ModelConfig, load_config
from gptoss_jax.safetensors_io import Reader
from pallas_kernels import params as params_lib

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint is missing a file or tensor, or a tensor has the wrong shape or dtype."""


# (field path in Params, HF name, original name); "{l}" is the layer index.
LAYER_TENSORS = [
    (("attn_norm",), "model.layers.{l}.input_layernorm.weight", "block.{l}.attn.norm.scale"),
    (("q_w",), "model.layers.{l}.self_attn.q_proj.weight", None),
    (("q_b",), "model.layers.{l}.self_attn.q_proj.bias", None),
    (("k_w",), "model.layers.{l}.self_attn.k_proj.weight", None),
    (("k_b",), "model.layers.{l}.self_attn.k_proj.bias", None),
    (("v_w",), "model.layers.{l}.self_attn.v_proj.weight", None),
    (("v_b",), "model.layers.{l}.self_attn.v_proj.bias", None),
    (("o_w",), "model.layers.{l}.self_attn.o_proj.weight", "block.{l}.attn.out.weight"),
    (("o_b",), "model.layers.{l}.self_attn.o_proj.bias", "block.{l}.attn.out.bias"),
    (("sinks",), "model.layers.{l}.self_attn.sinks", "block.{l}.attn.sinks"),
    (("mlp_norm",), "model.layers.{l}.post_attention_layernorm.weight", "block.{l}.mlp.norm.scale"),
    (("router_w",), "model.layers.{l}.mlp.router.weight", "block.{l}.mlp.gate.weight"),
    (("router_b",), "model.layers.{l}.mlp.router.bias", "block.{l}.mlp.gate.bias"),
    (
        ("experts", "gate_up_blocks"),
        "model.layers.{l}.mlp.experts.gate_up_proj_blocks",
        "block.{l}.mlp.mlp1_weight.blocks",
    ),
    (
        ("experts", "gate_up_scales"),
        "model.layers.{l}.mlp.experts.gate_up_proj_scales",
        "block.{l}.mlp.mlp1_weight.scales",
    ),
    (("experts", "gate_up_bias"), "model.layers.{l}.mlp.experts.gate_up_proj_bias", "block.{l}.mlp.mlp1_bias"),
    (("experts", "down_blocks"), "model.layers.{l}.mlp.experts.down_proj_blocks", "block.{l}.mlp.mlp2_weight.blocks"),
    (("experts", "down_scales"), "model.layers.{l}.mlp.experts.down_proj_scales", "block.{l}.mlp.mlp2_weight.scales"),
    (("experts", "down_bias"), "model.layers.{l}.mlp.experts.down_proj_bias", "block.{l}.mlp.mlp2_bias"),
]
GLOBAL_TENSORS = [
    (("embed",), "model.embed_tokens.weight", "embedding.weight"),
    (("final_norm",), "model.norm.weight", "norm.scale"),
    (("unembed",), "lm_head.weight", "unembedding.weight"),
]
# The original layout fuses q, k, v row-wise ([q | k | v]); HF splits it with no permutation.
ORIGINAL_QKV = {"weight": ("q_w", "k_w", "v_w"), "bias": ("q_b", "k_b", "v_b")}
PACKED_FIELDS = {"gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales"}


@dataclasses.dataclass(frozen=True)
class Target:
    """Where (part of) a file tensor goes: a Params field, a layer (or None), and a row range."""

    field: tuple[str, ...]
    layer: int | None
    rows: tuple[int, int] | None = None


def tensor_targets(cfg: ModelConfig, layout: str) -> dict[str, list[Target]]:
    """File tensor name -> where it lands, for layout 'hf' or 'original'."""
    col = 1 if layout == "hf" else 2
    out: dict[str, list[Target]] = {}
    for entry in GLOBAL_TENSORS:
        out[entry[col]] = [Target(entry[0], None)]
    nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    bounds = [(0, nq), (nq, nq + nkv), (nq + nkv, nq + 2 * nkv)]
    for l in range(cfg.num_layers):
        for entry in LAYER_TENSORS:
            if entry[col] is not None:
                out[entry[col].format(l=l)] = [Target(entry[0], l)]
        if layout == "original":
            for kind, fields in ORIGINAL_QKV.items():
                out[f"block.{l}.attn.qkv.{kind}"] = [Target((f,), l, b) for f, b in zip(fields, bounds)]
    return out


# Files of a Hugging Face repo that loading reads: the HF layout at its top level (`original/` and `metal/` hold the
# same weights again in other layouts) and the tokenizer's rank file when a repo ships it.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.tiktoken"]
HUB_IGNORE = ["original/*", "metal/*"]


def resolve_model(model: str | os.PathLike, *, revision: str | None = None, download_dir=None) -> Path:
    """A checkpoint folder for `model`: the local folder if it exists, else a Hugging Face repo id resolved by
    `huggingface_hub.snapshot_download` (its cache, or `download_dir`; `HF_HUB_OFFLINE=1` uses the cache alone;
    `revision` a branch, tag or commit). An error names both readings when neither works, as vLLM's `--model`."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    name = str(model)
    looks_like_repo = bool(re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name)) and not name.startswith((".", "/", "~"))
    if not looks_like_repo:
        raise CheckpointError(f"{name}: checkpoint folder not found (and not a Hugging Face repo id: 'org/name')")
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        folder = huggingface_hub.snapshot_download(
            name,
            revision=revision,
            cache_dir=download_dir,
            allow_patterns=HUB_PATTERNS,
            ignore_patterns=HUB_IGNORE,
        )
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{name}: no such local folder, and as a Hugging Face repo id (revision {revision or 'main'}, cache "
            f"{download_dir or constants.HF_HUB_CACHE}"
            f"{', HF_HUB_OFFLINE=1' if constants.HF_HUB_OFFLINE else ''}) it failed: "
            f"{type(e).__name__}: {first}"
        ) from None
    return Path(folder)


def find_files(path: Path) -> tuple[str, list[Path]]:
    """Layout ('hf' or 'original') and the safetensors files of a checkpoint folder."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint folder not found")
    for layout, folder in (("hf", path), ("original", path / "original")):
        if layout == "original" and (path / "config.json").exists():
            break
        index = folder / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: invalid index file ({e!r})") from None
            files = [folder / f for f in sorted(set(weight_map.values()))]
            for f in files:
                if not f.exists():
                    raise CheckpointError(f"{index}: lists shard '{f.name}', which is missing from {folder}")
            return layout, files
        files = sorted(folder.glob("*.safetensors"))
        if files:
            return layout, files
    raise CheckpointError(f"{path}: no *.safetensors files (looked in {path} and {path / 'original'})")


def device_shapes(cfg: ModelConfig, dtype, impl: str) -> params_lib.Params:
    """`params.shapes`, with the experts in the layout the kernels of `impl` read."""
    shapes = params_lib.shapes(cfg, dtype)
    experts = pallas_kernels.expert_shapes(shapes.layers.experts, impl)
    return shapes.replace(layers=shapes.layers.replace(experts=experts))


def load_params(
    path: str | Path, dtype=jnp.bfloat16, *, impl: str = "reference", progress: bool = True
) -> tuple[ModelConfig, params_lib.Params]:
    """Read a checkpoint folder into device `Params` (float weights in `dtype`, experts packed).

    Experts come out in the layout `impl` reads, converted tensor by tensor as they are read (a 120b
    checkpoint then fits one 80 GB GPU: it is never on the device in two layouts)."""
    path = Path(path)
    layout, files = find_files(path)
    cfg = load_config(path)
    shapes = params_lib.shapes(cfg, dtype)
    dev_shapes = device_shapes(cfg, dtype, impl)
    targets = tensor_targets(cfg, layout)
    pending = {(t.field, t.layer) for ts in targets.values() for t in ts}
    where: dict[tuple, str] = {}
    layered = {
        f: jnp.zeros(params_lib.get_field(dev_shapes, f).shape, params_lib.get_field(dev_shapes, f).dtype)
        for f in params_lib.field_paths(dev_shapes)
        if f[0] == "layers"
    }
    flat: dict[tuple, jax.Array] = {}
    unknown = []
    total = sum(f.stat().st_size for f in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"Loading {path.name}", disable=not progress) as bar:
        for file in files:
            reader = Reader(file)
            for name in reader.names():
                array = reader.get(name)
                bar.update(array.nbytes)
                if name not in targets:
                    unknown.append(name)
                    continue
                for t in targets[name]:
                    full = ("layers",) + t.field if t.layer is not None else t.field
                    want = params_lib.get_field(shapes, full)
                    want_shape = want.shape[1:] if t.layer is not None else want.shape
                    _check_tensor(name, file, reader.dtype_name(name), array.shape, want_shape, t, full)
                    part = array[t.rows[0] : t.rows[1]] if t.rows else array
                    if (t.field, t.layer) in where:
                        raise CheckpointError(f"{file}: tensor '{name}' also appears in {where[(t.field, t.layer)]}")
                    where[(t.field, t.layer)] = str(file)
                    if t.layer is None:
                        flat[full] = jnp.asarray(np.asarray(part), dtype=want.dtype)
                    else:
                        x = jnp.asarray(np.asarray(part))
                        if full[1] == "experts":
                            x = pallas_kernels.relayout_expert_field(full[2], x.astype(want.dtype), impl)
                            full = full[:2] + (pallas_kernels.expert_field(full[2], impl),)
                        layered[full] = params_lib.put_layer(layered[full], x, t.layer)
                    pending.discard((t.field, t.layer))
    if unknown:
        log.warning("%s: ignored %d tensors not used by gpt-oss, e.g. %s", path, len(unknown), unknown[:3])
    if pending:
        names = sorted(n for n, ts in targets.items() for t in ts if (t.field, t.layer) in pending)
        raise CheckpointError(
            f"{path}: missing {len(names)} tensor(s), e.g. {names[:5]} (searched {[f.name for f in files]})"
        )
    tree = dev_shapes
    for field, value in {**layered, **flat}.items():
        tree = params_lib.with_field(tree, field, value)
    return cfg, tree


def _check_tensor(name, file, dtype_name, shape, want_shape, t: Target, field) -> None:
    packed = field[-1] in PACKED_FIELDS
    if packed and dtype_name != "U8":
        raise CheckpointError(f"{file}: tensor '{name}' has dtype {dtype_name}, expected U8 (MXFP4 packed)")
    if not packed and dtype_name not in ("BF16", "F16", "F32"):
        raise CheckpointError(f"{file}: tensor '{name}' has dtype {dtype_name}, expected a float type (BF16)")
    if t.rows:
        ok = len(shape) == len(want_shape) and shape[1:] == tuple(want_shape[1:]) and shape[0] >= t.rows[1]
    else:
        ok = tuple(shape) == tuple(want_shape)
    if not ok:
        raise CheckpointError(
            f"{file}: tensor '{name}' has shape {list(shape)}, expected {list(want_shape)}"
            + (f" rows {t.rows} of the fused tensor" if t.rows else "")
        )


def load_placed(
    path: str | Path, dtype, kernels, layout=None, *, cache_dir: str | Path | None = None, progress: bool = True
) -> tuple[ModelConfig, params_lib.Params]:
    """The engine's loading (also `gptoss_jax.nnx.GptOss.from_pretrained`'s): `Params` placed by `layout` (a
    `sharding.rules.Layout`, or None for one device), in the layout the kernels of `kernels` (resolved for the
    device) read. Under a layout each device reads only its slice, unless an orbax `cache_dir` is restored."""
    if layout is not None and cache_dir is None:  # each device reads only its slice, experts padded
        cfg, params = load_params_sharded(path, dtype, layout, progress=progress)
    else:
        cfg, params = load(path, dtype, impl=kernels.impl, cache_dir=cache_dir, progress=progress)
        if layout is not None:
            params = layout.shard_params(params, cfg.num_kv_heads)
    return cfg, pallas_kernels.prepare_params(params, kernels)  # sharded: each device its experts


# ---- orbax cache of converted parameters -------------------------------------------------------


def fingerprint(path: Path, dtype, impl: str = "reference") -> str:
    """Identifies a checkpoint's files, the load dtype and the expert layout, so a stale cache is never restored."""
    _, files = find_files(path)
    h = hashlib.sha256(f"{jnp.dtype(dtype).name}:{impl}".encode())
    for f in files + [p for p in (path / "config.json", path / "original" / "config.json") if p.exists()]:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def load(
    path: str | Path,
    dtype=jnp.bfloat16,
    *,
    impl: str = "reference",
    cache_dir: str | Path | None = None,
    progress: bool = True,
) -> tuple[ModelConfig, params_lib.Params]:
    """`load_params`, restoring from / saving to an orbax cache under `cache_dir` when given."""
    path = Path(path)
    if cache_dir is None:
        return load_params(path, dtype, impl=impl, progress=progress)
    import orbax.checkpoint as ocp

    cfg = load_config(path)
    target = Path(cache_dir).resolve() / f"{path.name}-{fingerprint(path, dtype, impl)}"
    checkpointer = ocp.StandardCheckpointer()
    if target.exists():
        log.info("restoring converted parameters from %s", target)
        return cfg, checkpointer.restore(target, device_shapes(cfg, dtype, impl))
    cfg, params = load_params(path, dtype, impl=impl, progress=progress)
    checkpointer.save(target, params)
    checkpointer.wait_until_finished()
    log.info("saved converted parameters to %s", target)
    return cfg, params


# ---- sharded loading: each device reads only its slice ---------------------------------------------


def load_params_sharded(
    path: str | Path, dtype, layout, *, progress: bool = True
) -> tuple[ModelConfig, params_lib.Params]:
    """`load_params` straight into the placement of `layout` (a `sharding.rules.Layout`): every leaf is
    built with `jax.make_array_from_callback`, so each device copies only its own slice out of the
    memory-mapped safetensors (in a multi-host job each host reads only what its devices hold). The
    expert axis is padded with zero experts to a multiple of the `model` axis, as `Layout.shard_params`."""
    path = Path(path)
    kind, files = find_files(path)
    cfg = load_config(path)
    shapes = layout.padded_shapes(params_lib.shapes(cfg, dtype))
    plain = params_lib.shapes(cfg, dtype)
    shardings = layout.param_shardings(cfg.num_kv_heads, shapes)
    targets = tensor_targets(cfg, kind)
    src: dict[tuple, tuple[Reader, str, tuple | None]] = {}
    for file in files:
        reader = Reader(file)
        for name in reader.names():
            for t in targets.get(name, []):
                full = ("layers",) + t.field if t.layer is not None else t.field
                want = params_lib.get_field(plain, full)
                _check_tensor(
                    name,
                    file,
                    reader.dtype_name(name),
                    reader.shape(name),
                    want.shape[1:] if t.layer is not None else want.shape,
                    t,
                    full,
                )
                if (full, t.layer) in src:
                    raise CheckpointError(f"{file}: tensor '{name}' also appears in {src[(full, t.layer)][0].path}")
                src[(full, t.layer)] = (reader, name, t.rows)
    missing = sorted(
        n
        for n, ts in targets.items()
        for t in ts
        if ((("layers",) + t.field if t.layer is not None else t.field), t.layer) not in src
    )
    if missing:
        raise CheckpointError(
            f"{path}: missing {len(missing)} tensor(s), e.g. {missing[:5]} (searched {[f.name for f in files]})"
        )

    def source(full, layer):
        reader, name, rows = src[(full, layer)]
        a = reader.get(name)
        return a[rows[0] : rows[1]] if rows else a

    def build(full):
        sds, sharding = params_lib.get_field(shapes, full), params_lib.get_field(shardings, full)
        np_dtype = np.dtype(sds.dtype)
        if full[0] != "layers":
            return jax.make_array_from_callback(
                sds.shape, sharding, lambda idx: np.asarray(source(full, None)[idx]).astype(np_dtype)
            )
        num_real = params_lib.get_field(plain, full).shape[1] if full[1] == "experts" else None

        def per_device(idx):
            layers = range(*idx[0].indices(sds.shape[0]))
            rest = tuple(idx[1:]) + (slice(None),) * (len(sds.shape) - len(idx))
            dims = [len(range(*s.indices(n))) for s, n in zip(rest, sds.shape[1:])]
            out = np.zeros([len(layers)] + dims, np_dtype)
            for j, layer in enumerate(layers):
                a = source(full, layer)
                if num_real is not None:  # padded expert axis: ids >= num_real are zero experts
                    lo, hi, _ = rest[0].indices(sds.shape[1])
                    real = a[(slice(min(lo, num_real), min(hi, num_real)),) + rest[1:]]
                    out[j, : real.shape[0]] = real
                else:
                    out[j] = a[rest]
            return out

        return jax.make_array_from_callback(sds.shape, sharding, per_device)

    tree = shapes
    for field in tqdm(params_lib.field_paths(shapes), desc=f"Loading {path.name} (sharded)", disable=not progress):
        tree = params_lib.with_field(tree, field, build(field))
    return cfg, tree
