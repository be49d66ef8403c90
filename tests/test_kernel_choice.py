"""`pallas_kernels.choice.choose`: which kernel runs each operation of gpt-oss-20b and -120b at serving row counts, on
an H100, an H200 and a CPU, and the `KernelConfig` that feeds it (no kernel runs here: the choice alone); and the
output matrix's dtype that `prepare_params` keeps on a CPU."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from gptoss_jax import config, engine_config, model, random_weights
from pallas_kernels import KernelConfig, cpu_unembedding, kv_quant, paged_attention
from pallas_kernels.choice import CPU, H100, H200, Device, bf16_experts_unused, choose

PALLAS = KernelConfig(impl="pallas")
ROWS = (1, 4, 16, 64, 256, 16384)


def _moe_shape(preset):
    c = config.preset(preset)
    return (c.hidden_size, c.intermediate_size, c.num_experts, c.experts_per_token)


def _choices(op, preset, device, dtype=jnp.bfloat16, kernels=PALLAS, shape=None):
    return [choose(op, T, shape or _moe_shape(preset), dtype, device, kernels).kernel for T in ROWS]


@pytest.mark.parametrize("device", [H100, H200], ids=["h100", "h200"])
def test_moe_on_hopper(device):
    """bf16 on Hopper: the fused decode block to 8 tokens, the half-precision GEMV while experts average <= 2 rows,
    the Mosaic kernels to 32 rows per expert, then dequantized dense GEMMs (the 20b's 32 experts on the grouped
    Mosaic GEMMs, the 120b's 128 too, from 128 rows per expert)."""
    assert _choices("moe", "gpt-oss-20b", device) == ["route", "route", "gemv16", "mosaic", "mosaic", "grouped"]
    assert _choices("moe", "gpt-oss-120b", device) == ["route", "route", "gemv16", "gemv16", "mosaic", "grouped"]
    assert _choices("experts", "gpt-oss-20b", device) == ["gemv16", "gemv16", "gemv16", "mosaic", "mosaic", "grouped"]


def test_moe_without_mosaic():
    """Before Hopper, or with `mosaic: false`, the Triton tensor-core kernels take the mid-batch; fp32 models run
    the f32 GEMV at a token and never the fused block or the Mosaic kernels."""
    no_mosaic = dataclasses.replace(PALLAS, mosaic=False)
    assert _choices("moe", "gpt-oss-20b", H200, kernels=no_mosaic) == [
        "route",
        "route",
        "gemv16",
        "mma",
        "mma",
        "dense",
    ]
    assert _choices("moe", "gpt-oss-20b", CPU) == ["route", "route", "gemv16", "mma", "mma", "dense"]
    assert _choices("moe", "gpt-oss-120b", H200, dtype=jnp.float32) == ["gemv", "gemv", "gemv", "mma", "mma", "dense"]


def test_reference_everywhere_off_gpu_by_default():
    auto = KernelConfig()
    for op, shape in (
        ("moe", _moe_shape("gpt-oss-20b")),
        ("projection", (2880, 4096, 512, 512)),
        ("attention", (1, 64, 8, 64)),
    ):
        assert set(_choices(op, None, CPU, kernels=auto, shape=shape)) == {"reference"}
        assert "reference" not in _choices(op, None, H200, kernels=auto, shape=shape)[:1]
    assert set(_choices("moe", "gpt-oss-20b", H200, kernels=KernelConfig(impl="reference"))) == {"reference"}


@pytest.mark.parametrize("preset", ["gpt-oss-20b", "gpt-oss-120b"])
def test_projections(preset):
    """q/k/v (one input, three weights) and o: up to 7 rows on the Triton GEMV (q, k and v in one launch), 8-256
    rows on the Mosaic kernel on Hopper, else the GEMV to 64 rows (fused to 16) and XLA's GEMM beyond."""
    c = config.preset(preset)
    qkv = (c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim)
    o = (c.num_heads * c.head_dim, c.hidden_size)
    for shape in (qkv, o):
        assert _choices("projection", None, H200, shape=shape) == [
            "gemv",
            "gemv",
            "mosaic",
            "mosaic",
            "mosaic",
            "reference",
        ]
        assert _choices("projection", None, CPU, shape=shape) == [
            "gemv",
            "gemv",
            "gemv",
            "gemv",
            "reference",
            "reference",
        ]
    fused = [choose("projection", T, qkv, jnp.bfloat16, CPU, PALLAS).kw["fuse"] for T in (1, 16, 17, 64)]
    assert [choose("projection", T, qkv, jnp.bfloat16, H200, PALLAS).kernel for T in (7, 8)] == ["gemv", "mosaic"]
    assert fused == [True, True, False, False]
    # the Mosaic launch: one wave of the device's SMs, within shared memory (`linear_mosaic.config`)
    launch = choose("projection", 256, qkv, jnp.bfloat16, H200, PALLAS).kw
    assert set(launch) == {"splits", "stages"} and launch["splits"] >= 1 and 2 <= launch["stages"] <= 8
    assert choose("projection", 4, qkv, jnp.float32, H200, PALLAS).kernel == "gemv"  # wgmma reads 16-bit operands


@pytest.mark.parametrize("device", [H200, CPU], ids=["h200", "cpu"])
def test_attention(device):
    """Decode to `new_token_rows` (256) tokens takes the new-token kernel, one token a row or up to
    `attention_rows_tokens` (8, a verify step's); more tokens the paged decode kernel, one query row per token;
    prefill chunks the flash kernel; all with the config's launch settings."""
    heads = (64, 8, 64)
    assert _choices("attention", None, device, shape=(1, *heads)) == ["new_token"] * 5 + ["paged"]
    assert set(_choices("attention", None, device, shape=(512, *heads))) == {"flash"}
    for rows, T, kernel in ((64, 4, "new_token"), (32, 8, "new_token"), (65, 4, "paged_rows"), (1, 9, "flash")):
        assert choose("attention", rows, (T, *heads), jnp.bfloat16, device, PALLAS).kernel == kernel
    never = dataclasses.replace(PALLAS, attention_rows_tokens=0)  # a few tokens a row take the prefill kernel
    assert [choose("attention", 1, (T, *heads), jnp.bfloat16, device, never).kernel for T in (1, 2)] == [
        "new_token",
        "flash",
    ]
    launch = choose("attention", 1, (1, *heads), jnp.bfloat16, device, dataclasses.replace(PALLAS, attention_stages=2))
    assert launch.kw == dict(block_kv=64, num_stages=2, num_warps=2, split_programs=512, max_splits=32)


def test_fp8_attention_takes_its_own_launches():
    """Over an FP8 KV cache (the dtype the attention choice is given is the cache's) the decode kernels take the
    `attention_fp8_*` launch, one token per row or a few; prefill chunks the `flash_fp8_*` one."""
    heads, fp8 = (64, 8, 64), kv_quant.FP8
    for rows, T, kernel in ((64, 1, "new_token"), (64, 4, "new_token"), (128, 4, "paged_rows")):
        launch = choose("attention", rows, (T, *heads), fp8, H200, PALLAS)
        assert launch.kernel == kernel
        assert launch.kw == dict(block_kv=128, num_stages=5, num_warps=2, split_programs=512, max_splits=32)
    assert choose("attention", 512, (1, *heads), fp8, H200, PALLAS).kw["block_kv"] == 128  # the paged kernel
    config = dataclasses.replace(PALLAS, flash_fp8_block_q=64, flash_fp8_stages=4)
    assert choose("attention", 1, (512, *heads), fp8, H200, config).kw == dict(
        block_q=64, block_kv=64, num_warps=4, num_stages=4
    )
    assert choose("attention", 1, (512, *heads), jnp.bfloat16, H200, config).kw == dict(
        block_q=128, block_kv=64, num_warps=8, num_stages=3
    )


def test_decode_attention_splits_by_rows():
    """The default split target (512 programs) gives one sequence split a (row, KV head) from 64 rows (the 8k-context
    step measured fastest so, BENCHMARKS §16) and keeps batch 1-2 at the cap of 32 (the batch-1 step's setting)."""
    c = KernelConfig()
    M, S = 131072 // 16, 16  # a server's widest block table: splits do not depend on the context

    def splits(B):
        return paged_attention.default_splits(
            B, 8, M, S, c.attention_block_kv, c.attention_split_programs, c.attention_max_splits
        )

    assert [splits(B) for B in (1, 2, 4, 8, 16, 32, 64, 128, 256)] == [32, 32, 16, 8, 4, 2, 1, 1, 1]
    assert paged_attention.default_splits(1, 8, 64, S, 64, 512, 32) == 8  # a 1,024-key table: 2 blocks a split


def test_config_fields_are_the_switches():
    """Variants are configs: a threshold of 0 turns a kernel off, `for_device` resolves "auto"."""
    shape = _moe_shape("gpt-oss-20b")
    assert (
        choose("moe", 1, shape, jnp.bfloat16, H200, dataclasses.replace(PALLAS, moe_route_max_tokens=0)).kernel
        == "gemv16"
    )
    assert (
        choose("attention", 1, (1, 64, 8, 64), jnp.bfloat16, H200, dataclasses.replace(PALLAS, new_token_rows=0)).kernel
        == "paged"
    )
    resolved = KernelConfig().for_device(H100)
    assert (resolved.impl, resolved.mosaic, resolved.device) == ("pallas", True, H100)
    assert KernelConfig().for_device(CPU).impl == "reference"
    assert KernelConfig().for_device(Device("gpu", "8.0", 108)).mosaic is False  # Ampere: no wgmma
    hash(resolved)  # a static argument of the compiled steps


def test_bf16_experts_only_where_the_grouped_gemms_run():
    """`moe_prefill_bf16_experts` is read by the grouped prefill GEMMs only: bf16 models of up to
    `moe_grouped_experts` experts a device on Hopper with the kernels (20b; 120b too, where its copy fits: the
    loader checks the memory). Elsewhere it is ignored, for a reason."""
    on = dataclasses.replace(PALLAS, moe_prefill_bf16_experts=True)
    D, I, E, _ = _moe_shape("gpt-oss-20b")
    for device in (H100, H200):
        assert bf16_experts_unused((D, I, E), jnp.bfloat16, device, on) == ""
        assert bf16_experts_unused((D, I, 128), jnp.bfloat16, device, on) == ""  # 120b: grouped from 128 rows
        groups = dataclasses.replace(on, moe_grouped_experts=32)  # 120b on the Triton GEMMs in groups of 32
        assert bf16_experts_unused((D, I, 128), jnp.bfloat16, device, groups).startswith("128 experts")
        assert bf16_experts_unused((D, I, 32), jnp.bfloat16, device, groups) == ""  # 120b's share of 4 devices
    assert "fp32" in bf16_experts_unused((D, I, E), jnp.float32, H200, on)
    assert "Mosaic" in bf16_experts_unused((D, I, E), jnp.bfloat16, Device("gpu", "8.0", 108), on)
    assert "Mosaic" in bf16_experts_unused((D, I, E), jnp.bfloat16, H200, dataclasses.replace(on, mosaic=False))
    assert "reference" in bf16_experts_unused((D, I, E), jnp.bfloat16, CPU, KernelConfig())
    assert not KernelConfig().moe_prefill_bf16_experts  # opt-in: 38 GB for 20b
    with pytest.raises(ValueError, match="moe_prefill_bf16_experts=1: true or false"):
        KernelConfig(moe_prefill_bf16_experts=1)


def test_yaml_and_errors(tmp_path):
    path = tmp_path / "e.yaml"
    path.write_text("max_num_seqs: 4\nkernels:\n  mosaic: false\n  linear_stages: 2\n")
    ec = engine_config.load(path)
    assert ec.kernels == KernelConfig(mosaic=False, linear_stages=2)
    path.write_text("kernels:\n  moe_prefill_bf16_experts: true\n")
    assert engine_config.load(path).kernels == KernelConfig(moe_prefill_bf16_experts=True)
    path.write_text("kernels:\n  linear_stage: 2\n")
    with pytest.raises(config.ConfigError, match=r"e\.yaml.*unknown kernel setting 'linear_stage'"):
        engine_config.load(path)
    path.write_text("kernels:\n  linear_block_k: 0\n")
    with pytest.raises(config.ConfigError, match=r"e\.yaml.*kernels\.linear_block_k=0: must be an integer >= 1"):
        engine_config.load(path)
    with pytest.raises(ValueError, match="impl='triton'"):
        KernelConfig(impl="triton")
    with pytest.raises(ValueError, match="at most 64 rows"):
        KernelConfig(linear_gemv_rows=65)
    with pytest.raises(ValueError, match="unknown operation"):
        choose("norm", 1, (), jnp.bfloat16, CPU, PALLAS)


def test_a_cpu_keeps_the_output_matrix_in_f32_with_the_same_logits():
    """On a CPU a bf16 model's unembedding is stored in f32 (XLA's CPU dot converted the bf16 matrix every call): the
    same values, logits bit-identical for one row and within float rounding for several; a GPU keeps bf16, an fp32
    model is left alone."""
    cfg = config.from_hf_dict(json.loads((Path(__file__).parent / "tiny_config.json").read_text()))
    params = random_weights.random_params(cfg, jnp.bfloat16)
    assert params.embed.dtype == jnp.bfloat16 and params.unembed.dtype == jnp.float32  # prepared for this CPU
    half = params.replace(unembed=params.unembed.astype(jnp.bfloat16))
    assert bool(jnp.all(params.unembed == half.unembed))  # the same values
    x = jax.random.normal(jax.random.PRNGKey(1), (3, cfg.hidden_size)).astype(jnp.bfloat16)
    assert bool(jnp.all(model.unembed(params, x[:1]) == model.unembed(half, x[:1])))
    ours, theirs = model.unembed(params, x), model.unembed(half, x)
    assert float(jnp.max(jnp.abs(ours - theirs))) <= 1e-5 * float(jnp.max(jnp.abs(theirs)))
    assert cpu_unembedding(half, H200).unembed.dtype == jnp.bfloat16
    assert cpu_unembedding(half, CPU).unembed.dtype == jnp.float32
    f32 = random_weights.random_params(cfg, jnp.float32)
    assert cpu_unembedding(f32, CPU) is f32
