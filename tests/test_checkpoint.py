import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from parity_configs import PARITY

import pallas_kernels
from gptoss_jax import checkpoint, random_weights, safetensors_io
from gptoss_jax.checkpoint import CheckpointError
from pallas_kernels import KernelConfig, expert_format
from pallas_kernels import params as params_lib

CFG = PARITY["small"]["config"]


def _leaves_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _to_original(src, dst):
    """Rewrite a HF-layout checkpoint in OpenAI's original layout (fused qkv, reference names)."""
    reader = safetensors_io.Reader(src / "model.safetensors")
    cfg = checkpoint.load_config(src)
    hf_to_orig = {}
    for entry in checkpoint.GLOBAL_TENSORS:
        hf_to_orig[entry[1]] = entry[2]
    for l in range(cfg.num_layers):
        for entry in checkpoint.LAYER_TENSORS:
            if entry[2]:
                hf_to_orig[entry[1].format(l=l)] = entry[2].format(l=l)
    tensors = {hf_to_orig[n]: np.asarray(reader.get(n)) for n in reader.names() if n in hf_to_orig}
    for l in range(cfg.num_layers):
        for kind in ("weight", "bias"):
            parts = [np.asarray(reader.get(f"model.layers.{l}.self_attn.{p}_proj.{kind}")) for p in "qkv"]
            tensors[f"block.{l}.attn.qkv.{kind}"] = np.concatenate(parts, axis=0)
    (dst / "original").mkdir(parents=True)
    specs = {n: (t.shape, t.dtype) for n, t in tensors.items()}
    safetensors_io.write(dst / "original" / "model.safetensors", tensors.items(), specs)
    (dst / "original" / "config.json").write_text(json.dumps(random_weights.to_original_config(CFG)))


def test_hf_single_sharded_and_original_layouts_agree(small_checkpoint, tmp_path):
    _, ref = checkpoint.load_params(small_checkpoint, jnp.float32, progress=False)
    sharded = random_weights.write_checkpoint(
        tmp_path / "sharded",
        CFG,
        seed=PARITY["small"]["seed"],
        sink_scale=PARITY["small"]["sink_scale"],
        max_shard_bytes=60_000,
        progress=False,
    )
    assert len(list(sharded.glob("*.safetensors"))) > 2 and (sharded / "model.safetensors.index.json").exists()
    _, p_sharded = checkpoint.load_params(sharded, jnp.float32, progress=False)
    _leaves_equal(ref, p_sharded)
    _to_original(small_checkpoint, tmp_path / "orig")
    _, p_orig = checkpoint.load_params(tmp_path / "orig", jnp.float32, progress=False)
    _leaves_equal(ref, p_orig)


def test_kernel_layout_loads_tensor_by_tensor(small_checkpoint, tmp_path):
    """`impl="pallas"` relayouts each expert tensor as it loads: the same arrays as relayouting the
    loaded checkpoint afterwards, in both checkpoint layouts, and the orbax cache keys on the layout."""
    _, ref = checkpoint.load_params(small_checkpoint, jnp.float32, progress=False)
    want = pallas_kernels.prepare_params(ref, KernelConfig(impl="pallas"))
    assert isinstance(want.layers.experts, expert_format.KernelExperts)
    _leaves_equal(want.layers.experts, expert_format.prepare_experts(ref.layers.experts))
    assert pallas_kernels.prepare_params(want, KernelConfig(impl="pallas")) is want  # already in kernel layout
    # uncommitted like the rest: a committed parameter makes each warmed-up step compile again at its first call
    assert not any(a.committed for a in jax.tree.leaves(want))
    _, direct = checkpoint.load_params(small_checkpoint, jnp.float32, impl="pallas", progress=False)
    _leaves_equal(want, direct)
    _to_original(small_checkpoint, tmp_path / "orig")
    _leaves_equal(want, checkpoint.load_params(tmp_path / "orig", jnp.float32, impl="pallas", progress=False)[1])
    _, cached = checkpoint.load(small_checkpoint, jnp.float32, impl="pallas", cache_dir=tmp_path / "c", progress=False)
    _, plain = checkpoint.load(small_checkpoint, jnp.float32, cache_dir=tmp_path / "c", progress=False)
    assert len(list((tmp_path / "c").iterdir())) == 2
    _leaves_equal(want, cached)
    _leaves_equal(
        want, checkpoint.load(small_checkpoint, jnp.float32, impl="pallas", cache_dir=tmp_path / "c", progress=False)[1]
    )
    assert isinstance(plain.layers.experts, params_lib.Experts)


def test_experts_stay_packed_and_dtypes(small_checkpoint):
    _, p = checkpoint.load_params(small_checkpoint, jnp.bfloat16, progress=False)
    assert p.layers.experts.gate_up_blocks.dtype == jnp.uint8
    assert p.layers.experts.gate_up_blocks.shape == (2, 4, 128, 2, 16)
    assert p.layers.q_w.dtype == jnp.bfloat16 and p.layers.attn_norm.dtype == jnp.float32
    assert p.layers.sinks.dtype == jnp.float32


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite(path, edit):
    """Rewrite model.safetensors after `edit(dict name -> array)`."""
    r = safetensors_io.Reader(path / "model.safetensors")
    tensors = {n: np.array(r.get(n)) for n in r.names()}
    del r
    edit(tensors)
    specs = {n: (t.shape, t.dtype) for n, t in tensors.items()}
    safetensors_io.write(path / "model.safetensors", tensors.items(), specs)


def test_missing_tensor_named(small_checkpoint, tmp_path):
    p = _copy(small_checkpoint, tmp_path / "c")
    _rewrite(p, lambda t: t.pop("model.layers.1.self_attn.sinks"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor.*model\.layers\.1\.self_attn\.sinks"):
        checkpoint.load_params(p, progress=False)


def test_wrong_shape_named(small_checkpoint, tmp_path):
    p = _copy(small_checkpoint, tmp_path / "c")
    _rewrite(
        p, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": t["model.layers.0.self_attn.q_proj.bias"][:10]})
    )
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.q_proj\.bias' "
        r"has shape \[10\], expected \[64\]",
    ):
        checkpoint.load_params(p, progress=False)


def test_wrong_dtype_named(small_checkpoint, tmp_path):
    p = _copy(small_checkpoint, tmp_path / "c")
    name = "model.layers.0.mlp.experts.down_proj_blocks"
    _rewrite(p, lambda t: t.update({name: t[name].astype(np.float32)}))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has dtype F32, expected U8"):
        checkpoint.load_params(p, progress=False)


def test_missing_files(small_checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint folder not found"):
        checkpoint.load_params(tmp_path / "nope", progress=False)
    sharded = random_weights.write_checkpoint(tmp_path / "s", CFG, max_shard_bytes=60_000, progress=False)
    victim = sorted(sharded.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"lists shard '{victim.name}', which is missing"):
        checkpoint.load_params(sharded, progress=False)
    p = _copy(small_checkpoint, tmp_path / "c")
    (p / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken")
    with pytest.raises(ValueError, match="corrupt header"):
        checkpoint.load_params(p, progress=False)


def test_orbax_cache_skips_conversion(small_checkpoint, tmp_path, monkeypatch):
    cfg, first = checkpoint.load(small_checkpoint, jnp.float32, cache_dir=tmp_path, progress=False)
    assert len(list(tmp_path.iterdir())) == 1

    def fail(*a, **k):
        raise AssertionError("conversion ran again")

    monkeypatch.setattr(checkpoint, "load_params", fail)
    cfg2, second = checkpoint.load(small_checkpoint, jnp.float32, cache_dir=tmp_path, progress=False)
    assert cfg2 == cfg
    _leaves_equal(first, second)
    assert second.layers.experts.gate_up_blocks.dtype == jnp.uint8


def _fake_hub_cache(cache, repo: str, source: Path, revision: str = "main") -> Path:
    """A Hugging Face hub cache on disk, laid out as huggingface_hub writes it (blobs, refs, snapshots)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo_dir / "blobs").mkdir()
    for f in source.iterdir():
        blob = repo_dir / "blobs" / f"blob-{f.name}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / revision).write_text(commit)
    return snapshot


def test_resolve_model_local_folder_and_hub_cache_offline(small_checkpoint, tmp_path, monkeypatch):
    """`--model` is a local folder or a Hugging Face repo id; offline the id resolves from the hub cache alone."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # what HF_HUB_OFFLINE=1 sets at import
    assert checkpoint.resolve_model(small_checkpoint) == small_checkpoint
    snapshot = _fake_hub_cache(tmp_path / "hub", "acme/tiny-oss", small_checkpoint)
    got = checkpoint.resolve_model("acme/tiny-oss", download_dir=tmp_path / "hub")
    assert got == snapshot and checkpoint.load_config(got) == checkpoint.load_config(small_checkpoint)
    _fake_hub_cache(tmp_path / "hub2", "acme/tiny-oss", small_checkpoint, revision="v1")
    assert checkpoint.resolve_model("acme/tiny-oss", revision="v1", download_dir=tmp_path / "hub2").is_dir()
    # neither reading works: one error naming both, the cache and the offline mode
    with pytest.raises(CheckpointError, match=r"acme/missing: no such local folder, and as a Hugging Face repo id "):
        checkpoint.resolve_model("acme/missing", download_dir=tmp_path / "hub")
    with pytest.raises(CheckpointError, match=r"revision v2.*HF_HUB_OFFLINE=1"):
        checkpoint.resolve_model("acme/tiny-oss", revision="v2", download_dir=tmp_path / "hub")
    with pytest.raises(CheckpointError, match="checkpoint folder not found"):
        checkpoint.resolve_model(tmp_path / "no" / "such" / "dir")
