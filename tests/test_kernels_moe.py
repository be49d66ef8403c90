"""The Pallas MXFP4 MoE kernels (CPU interpret mode) against `moe_reference` on fresh random inputs."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import expert_format, moe_dense, moe_gemv, moe_mma, moe_reference, moe_slots, mxfp4
from pallas_kernels import params as params_lib
from pallas_kernels.choice import CPU, H200, REFERENCE, Device, KernelConfig, choose
from pallas_kernels.params import Experts

KERNELS = KernelConfig(impl="pallas")

LIMIT, ALPHA = 7.0, 1.702


def _experts(rng, E, D, I, dtype):
    u8 = lambda *s: jnp.asarray(rng.integers(0, 256, s, dtype=np.uint8))
    sc = lambda *s: jnp.asarray(rng.integers(117, 129, s, dtype=np.uint8))
    return Experts(
        gate_up_blocks=u8(E, 2 * I, D // 32, 16),
        gate_up_scales=sc(E, 2 * I, D // 32),
        gate_up_bias=jnp.asarray(rng.normal(size=(E, 2 * I)), dtype),
        down_blocks=u8(E, D, I // 32, 16),
        down_scales=sc(E, D, I // 32),
        down_bias=jnp.asarray(rng.normal(size=(E, D)), dtype),
    )


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_word_encoding_decodes_to_checkpoint_values():
    """The re-packed u32 words, decoded the kernels' way, give exactly mxfp4.dequantize (x 2^-14)."""
    rng = np.random.default_rng(1)
    blocks = jnp.asarray(rng.integers(0, 256, (5, 3, 16), dtype=np.uint8))
    words = expert_format.encode_words(blocks)  # [5, 12]
    vals = np.stack([np.asarray(v) for v in expert_format.decode_words(words)], axis=-1)  # [5, 12, 8]
    ref = mxfp4.dequantize_np(np.asarray(blocks), np.full((5, 3), 127, np.uint8))
    np.testing.assert_array_equal(vals.reshape(5, 96) * 2.0**14, ref)


def test_prepare_experts_phase_order():
    rng = np.random.default_rng(2)
    E, D, I = 2, 64, 96
    ex = _experts(rng, E, D, I, jnp.bfloat16)
    kx = expert_format.prepare_experts(ex)
    order = expert_format.phase_order(I)
    gu = np.asarray(ex.gate_up_blocks)
    for c in (0, 5, I - 1):
        i = order[c]
        np.testing.assert_array_equal(
            np.asarray(kx.gu_words[:, 0, c]), np.asarray(expert_format.encode_words(jnp.asarray(gu[:, 2 * i])))
        )
        np.testing.assert_array_equal(np.asarray(kx.gu_bias[:, 1, c]), np.asarray(ex.gate_up_bias[:, 2 * i + 1]))
    assert kx.dn_words.nbytes == ex.down_blocks.nbytes
    x = jnp.arange(2 * I, dtype=jnp.float32).reshape(2, I)
    np.testing.assert_array_equal(np.asarray(expert_format.to_phases(x)).reshape(2, I), np.asarray(x)[:, order])


@pytest.mark.parametrize(
    "T,E,k,D,I,empty,cfg",
    [
        (1, 8, 4, 96, 64, False, {}),
        (5, 8, 4, 96, 64, True, dict(kernel="gemv", block_m=2, block_k=64, block_n=32, prefetch=False)),  # K tail
        (13, 4, 2, 64, 96, True, dict(kernel="mma", block_m=16, block_k=64)),
        # the 128-row tiles of mid-size prefills past 32 experts (the CPU takes them too: no Mosaic)
        (200, 4, 2, 64, 128, True, dict(block_k=64)),  # 133 rows per routed expert: more than one tile
        (1, 8, 4, 96, 64, False, dict(kernel="gemv16", block_k=64)),  # K tail
        (9, 4, 4, 64, 96, True, dict(kernel="gemv16", block_m=2, block_k=64, prefetch=False)),
    ],
)
def test_moe_decode_matches_reference(T, E, k, D, I, empty, cfg):
    rng = np.random.default_rng(T * 100 + E)
    ex = _experts(rng, E, D, I, jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(T, D)) * 2, jnp.bfloat16)
    rw = jnp.asarray(rng.normal(size=(E, D)) * 0.2, jnp.bfloat16)
    rb = np.zeros((E,), np.float32)
    if empty:
        rb[0] = -1e4  # expert 0 never routed
    rb = jnp.asarray(rb, jnp.bfloat16)
    ref = moe_reference.moe(x, rw, rb, ex, top_k=k, swiglu_limit=LIMIT, swiglu_alpha=ALPHA)
    out = _moe(x, rw, rb, expert_format.prepare_experts(ex), k, cfg)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert _rel(out, ref) < 1e-2


def _moe(x, rw, rb, kexp, k, cfg):
    """Routing, then the experts on the kernel the CPU choice names for these rows (the tensor-core or GEMV
    kernels), with `cfg` replacing the kernel and settings it names."""
    idx, w, _ = moe_reference.route(x, rw, rb, k)
    D, E = x.shape[1], rw.shape[0]
    base = choose("experts", x.shape[0], (D, kexp.gu_words.shape[-2], E, k), x.dtype, CPU, KERNELS)
    launch = base.kw | cfg
    kernel = launch.pop("kernel", base.kernel)
    return pallas_kernels._EXPERTS[kernel](
        x, idx, w, kexp, swiglu_limit=LIMIT, swiglu_alpha=ALPHA, interpret=True, **launch
    )


def test_moe_prefill_fused_mma_f32_activations():
    """The fused tensor-core kernels with large row tiles (shrunk), f32 model dtype, 37 tokens (odd)."""
    rng = np.random.default_rng(7)
    T, E, k, D, I = 37, 8, 4, 64, 64
    ex = _experts(rng, E, D, I, jnp.float32)
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
    rw = jnp.asarray(rng.normal(size=(E, D)) * 0.2, jnp.float32)
    rb = jnp.asarray(np.where(np.arange(E) == 3, -1e4, 0.0), jnp.float32)
    ref = moe_reference.moe(x, rw, rb, ex, top_k=k, swiglu_limit=LIMIT, swiglu_alpha=ALPHA)
    idx, w, _ = moe_reference.route(x, rw, rb, k)
    out = moe_mma.experts(
        x,
        idx,
        w,
        expert_format.prepare_experts(ex),
        swiglu_limit=LIMIT,
        swiglu_alpha=ALPHA,
        interpret=True,
        block_m=16,
        block_n=32,
        block_k=64,
        block_n_down=32,
        num_warps=4,
        num_stages=1,
        swap=True,
    )
    assert _rel(out, ref) < 1e-2  # kernel operands are bf16


def test_dequantize_kernel_gives_checkpoint_values_in_natural_order():
    """The dense path's dequantization undoes the gate/up phase order and matches mxfp4.dequantize (x 2^-14)
    exactly, starting at a traced row offset."""
    rng = np.random.default_rng(5)
    E, D, I = 3, 96, 64
    ex = _experts(rng, E, D, I, jnp.float32)
    kx = expert_format.prepare_experts(ex)
    ref = np.asarray(mxfp4.dequantize(ex.gate_up_blocks, ex.gate_up_scales, jnp.float32))  # [E, 2I, D] interleaved
    ref = ref.reshape(E, I, 2, D).transpose(0, 2, 1, 3)  # [E, 2, I, D]
    got = moe_dense.dequantize(
        kx.gu_words.reshape(-1, D // 8),
        kx.gu_scales.reshape(-1, D // 32),
        jnp.int32(2 * I),
        2 * 2 * I,
        jnp.float32,
        perm_I=I,
        interpret=True,
        block_k=64,
    )
    np.testing.assert_array_equal(np.asarray(got).reshape(2, 2, I, D) * 2.0**14, ref[1:])
    ref_dn = np.asarray(mxfp4.dequantize(ex.down_blocks, ex.down_scales, jnp.float32))
    got = moe_dense.dequantize(
        kx.dn_words.reshape(-1, I // 8),
        kx.dn_scales.reshape(-1, I // 32),
        jnp.int32(0),
        E * D,
        jnp.float32,
        interpret=True,
        block_k=64,
    )
    np.testing.assert_array_equal(np.asarray(got).reshape(E, D, I) * 2.0**14, ref_dn)


@pytest.mark.parametrize(
    "T,E,k,D,I,group,bn,dtype,valid",
    [
        (37, 8, 4, 96, 64, 3, 64, jnp.float32, False),  # 3 expert groups, K tail, odd tokens, stacked layers,
        # a masked last feature tile of the down GEMM
        (50, 4, 2, 64, 96, 4, 32, jnp.bfloat16, True),  # pairs skipped (expert parallelism)
    ],
)
def test_dense_prefill_matches_reference(T, E, k, D, I, group, bn, dtype, valid):
    rng = np.random.default_rng(T)
    layers = [_experts(rng, E, D, I, dtype) for _ in range(2)]
    stacked = expert_format.prepare_experts(jax.tree.map(lambda *a: jnp.stack(a), *layers))
    x = jnp.asarray(rng.normal(size=(T, D)), dtype)
    idx = jnp.asarray(np.stack([1 + rng.permutation(E - 1)[:k] for _ in range(T)]), jnp.int32)  # expert 0 empty
    w = jnp.asarray(rng.random((T, k)), jnp.float32)
    mask = jnp.asarray(rng.random((T, k)) < 0.6) if valid else None
    cfg = dict(block_m=16, block_n=bn, block_k=64, num_warps=4, num_stages=1, group=group)
    out = moe_dense.experts(
        x, idx, w, stacked, jnp.int32(1), mask, swiglu_limit=LIMIT, swiglu_alpha=ALPHA, interpret=True, **cfg
    )
    ref = moe_reference.apply_experts(
        x, idx, w if mask is None else jnp.where(mask, w, 0.0), layers[1], swiglu_limit=LIMIT, swiglu_alpha=ALPHA
    )
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert _rel(out, ref) < (1e-2 if dtype == jnp.bfloat16 else 1e-5)


@pytest.mark.parametrize("valid", [False, True])
def test_grouped_prefill_matches_reference(valid):
    """The grouped-GEMM path (on Hopper jax's Mosaic GPU ragged dot; elsewhere `lax.ragged_dot` stands in):
    stacked layers, an empty expert, odd token count, and pairs skipped (expert parallelism)."""
    T, E, k, D, I = 151, 4, 2, 256, 320
    rng = np.random.default_rng(T + valid)
    layers = [_experts(rng, E, D, I, jnp.bfloat16) for _ in range(2)]
    stacked = expert_format.prepare_experts(jax.tree.map(lambda *a: jnp.stack(a), *layers))
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.bfloat16)
    idx = jnp.asarray(np.stack([1 + rng.permutation(E - 1)[:k] for _ in range(T)]), jnp.int32)  # expert 0 empty
    w = jnp.asarray(rng.random((T, k)), jnp.float32)
    mask = jnp.asarray(rng.random((T, k)) < 0.6) if valid else None
    assert moe_dense.grouped_fits(D, I, E, T * k)
    out = moe_dense.experts_grouped(
        x,
        idx,
        w,
        stacked,
        jnp.int32(1),
        mask,
        swiglu_limit=LIMIT,
        swiglu_alpha=ALPHA,
        interpret=None if Device.current().hopper else True,
    )
    ref = moe_reference.apply_experts(
        x, idx, w if mask is None else jnp.where(mask, w, 0.0), layers[1], swiglu_limit=LIMIT, swiglu_alpha=ALPHA
    )
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("P,I,block_n", [(301, 320, 256), (37, 64, 64)])
def test_swiglu_epilogue_matches_xla(P, I, block_n):
    """The grouped path's gate/up epilogue kernel against the XLA expression it replaced: sorted experts with
    empty ones (0, 2, the last), values past the clamp on both sides, row and feature tiles cut short."""
    E = 5
    rng = np.random.default_rng(P)
    e = jnp.asarray(np.sort(rng.choice([1, 3], size=P)), jnp.int32)
    z = jnp.asarray(rng.normal(size=(P, 2 * I)) * 10 * 2.0**-14, jnp.bfloat16)  # |z| * 2^14 up to ~40
    bias = jnp.asarray(rng.normal(size=(E, 2, I)), jnp.bfloat16)
    got = moe_dense.swiglu_epilogue(z, e, bias, limit=LIMIT, alpha=ALPHA, block_n=block_n, interpret=True)
    want = moe_dense.swiglu_epilogue_reference(z, e, bias, limit=LIMIT, alpha=ALPHA)
    assert (np.abs(np.asarray(z, np.float32) * 2.0**14) > LIMIT + 3).mean() > 0.3
    assert got.dtype == jnp.bfloat16 and got.shape == (P, I)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2**-7)


# The grouped path on a CPU: Mosaic asked for (as on Hopper), the kernels interpreted (`lax.ragged_dot` for the GEMMs).
GROUPED_CPU = KernelConfig(impl="pallas", mosaic=True).for_device(CPU)


def _grouped_here():
    """(kernels, interpret): the grouped path on this machine, as the kernels on Hopper, else interpreted."""
    hopper = Device.current().hopper
    return KernelConfig(impl="pallas", mosaic=True).for_device(None if hopper else CPU), not hopper


def _stacked_experts(rng, L, E, D, I):
    return expert_format.prepare_experts(
        jax.tree.map(lambda *a: jnp.stack(a), *[_experts(rng, E, D, I, jnp.bfloat16) for _ in range(L)])
    )


def _bits(a):
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint16))


@pytest.mark.parametrize("valid", [False, True])
def test_grouped_prefill_with_stored_bf16_experts_is_bit_identical(valid):
    """`KernelConfig.moe_prefill_bf16_experts`: the stored copy is each layer's `dequantize_experts` bit for bit
    (layout and the 2^-14 scaling included), and the grouped path reading it (the whole stack, at the layer's
    first expert) gives exactly the output of dequantizing per call: stacked layers, the layer traced, an empty
    expert, an odd token count, pairs skipped (expert parallelism); through the kernel choice, routing included.
    On Hopper the kernels run (jax's Mosaic GPU ragged dot on the view of the stack), elsewhere interpreted."""
    T, E, k, D, I, L = 151, 4, 2, 256, 320, 3
    kernels, interpret = _grouped_here()  # on Hopper the kernels: jax's ragged dot reading the stack in place
    rng = np.random.default_rng(7 + valid)
    kx = _stacked_experts(rng, L, E, D, I)
    stored = pallas_kernels.with_bf16_experts(kx, interpret=interpret)
    assert stored.gu_bf16.shape == (L, E, 2 * I, D) and stored.dn_bf16.shape == (L, E, D, I)
    assert stored.gu_bf16.dtype == stored.dn_bf16.dtype == jnp.bfloat16
    assert not stored.gu_bf16.committed and not stored.dn_bf16.committed  # as every parameter (no recompiles)
    for layer in range(L):
        gu, dn = moe_dense.dequantize_experts(
            kx.gu_words, kx.gu_scales, kx.dn_words, kx.dn_scales, jnp.int32(layer), interpret=interpret
        )
        np.testing.assert_array_equal(_bits(stored.gu_bf16[layer]), _bits(gu))
        np.testing.assert_array_equal(_bits(stored.dn_bf16[layer]), _bits(dn))
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.bfloat16)
    idx = jnp.asarray(np.stack([1 + rng.permutation(E - 1)[:k] for _ in range(T)]), jnp.int32)  # expert 0 empty
    w = jnp.asarray(rng.random((T, k)), jnp.float32)
    mask = jnp.asarray(rng.random((T, k)) < 0.6) if valid else None
    run = lambda ex: moe_dense.experts_grouped(  # noqa: E731
        x, idx, w, ex, jnp.int32(1), mask, swiglu_limit=LIMIT, swiglu_alpha=ALPHA, interpret=interpret
    )
    np.testing.assert_array_equal(_bits(run(stored)), _bits(run(kx)))
    # the model's entry point: routing, then the choice's grouped GEMMs (pairs >= moe_dense_rows per expert)
    assert choose("experts", T, (D, I, E, k), jnp.bfloat16, kernels.device, kernels).kernel == "grouped"
    router_w = jnp.asarray(rng.normal(size=(E, D)), jnp.bfloat16)
    router_b = jnp.asarray(rng.normal(size=(E,)), jnp.bfloat16)
    moe = lambda ex: pallas_kernels.moe(  # noqa: E731
        x,
        router_w,
        router_b,
        ex,
        top_k=k,
        swiglu_limit=LIMIT,
        swiglu_alpha=ALPHA,
        layer=jnp.int32(2),
        kernels=kernels,
    )
    np.testing.assert_array_equal(_bits(moe(stored)), _bits(moe(kx)))


def test_prepare_params_stores_the_bf16_experts_only_when_asked_and_used(caplog, monkeypatch):
    """Random weights end in `prepare_params`, as the checkpoint loader and the engine: with the option, where the
    grouped GEMMs run, the copy is part of the params tree (counted by `params.nbytes`, as the engine's memory
    accounting counts what is in use); without it, none (a copy in the given tree is dropped); a model the grouped
    GEMMs never see (more experts than `moe_grouped_experts`, the reference implementation), or whose copy would
    take more than half of the devices' free memory (120b on one GPU: 229 GB), gets none, logged with the reason."""
    from gptoss_jax import config, random_weights

    hf = dict(random_weights.DEMO_CONFIG, vocab_size=512, hidden_size=256, intermediate_size=256, head_dim=64)
    cfg = config.from_hf_dict(hf)
    on = dataclasses.replace(GROUPED_CPU, moe_prefill_bf16_experts=True)
    params = random_weights.random_params(cfg, jnp.bfloat16, kernels=on)
    ex = params.layers.experts
    L, E, D, I = cfg.num_layers, cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    assert ex.gu_bf16.shape == (L, E, 2 * I, D) and ex.dn_bf16.shape == (L, E, D, I)
    plain = pallas_kernels.prepare_params(params, GROUPED_CPU)
    assert plain.layers.experts.gu_bf16 is None and plain.layers.experts.dn_bf16 is None
    assert params_lib.nbytes(params) - params_lib.nbytes(plain) == 3 * L * E * D * I * 2
    again = pallas_kernels.with_bf16_experts(plain.layers.experts, interpret=jax.default_backend() != "gpu")
    np.testing.assert_array_equal(_bits(again.gu_bf16), _bits(ex.gu_bf16))
    np.testing.assert_array_equal(_bits(again.dn_bf16), _bits(ex.dn_bf16))
    assert pallas_kernels.prepare_params(params, on) is params  # made once
    with caplog.at_level("INFO", logger="pallas_kernels"):
        groups = dataclasses.replace(on, moe_grouped_experts=32)
        big = random_weights.random_params(config.from_hf_dict(dict(hf, num_local_experts=40)), kernels=groups)
        assert big.layers.experts.gu_bf16 is None
        assert "moe_prefill_bf16_experts ignored: 40 experts of 256 x 256 a device" in caplog.text
        caplog.clear()

        def free(mib):  # devices reporting `mib` MiB free in their pool
            stats = {"bytes_limit": 100 * 2**20, "bytes_in_use": (100 - mib) * 2**20}
            monkeypatch.setattr(pallas_kernels, "_memory_stats", lambda device: stats)

        free(5)  # the copy takes 3 L E D I bf16 values: 3.1 MB, more than half of 5 MiB
        assert pallas_kernels.prepare_params(plain, on).layers.experts.gu_bf16 is None
        assert (
            "ignored: its 0.0 GB a device (0.0 GB in all) would take more than half of the 0.0 GB free" in caplog.text
        )
        free(7)
        assert pallas_kernels.prepare_params(plain, on).layers.experts.gu_bf16 is not None
        monkeypatch.undo()
        caplog.clear()
        ref = random_weights.random_params(cfg, kernels=dataclasses.replace(REFERENCE, moe_prefill_bf16_experts=True))
        assert isinstance(ref.layers.experts, Experts)
        assert "moe_prefill_bf16_experts ignored: the pure-JAX reference" in caplog.text


def test_stored_bf16_experts_reach_the_ragged_dot_whole():
    """Lowered for an H200 (on this CPU): with the stored copy the two Mosaic GPU ragged dots take the whole
    `[L E, N, K]` stack (`pallas_kernels.ragged_dot`: no slice of it, which would copy the layer, 20b: 1.6 GB), and
    no dequantization kernel runs."""
    from tools import inspect_kernels

    T, E, k, D, I, L = 151, 4, 2, 256, 320, 3
    kx = jax.eval_shape(lambda: _stacked_experts(np.random.default_rng(0), L, E, D, I))
    stored = kx.replace(
        gu_bf16=jax.ShapeDtypeStruct((L, E, 2 * I, D), jnp.bfloat16),
        dn_bf16=jax.ShapeDtypeStruct((L, E, D, I), jnp.bfloat16),
    )
    args = (
        jax.ShapeDtypeStruct((T, D), jnp.bfloat16),
        jax.ShapeDtypeStruct((T, k), jnp.int32),
        jax.ShapeDtypeStruct((T, k), jnp.float32),
    )

    def lowered(ex):
        f = jax.jit(
            lambda x, i, w, ex, layer: moe_dense.experts_grouped(
                x, i, w, ex, layer, swiglu_limit=LIMIT, swiglu_alpha=ALPHA, interpret=False
            )
        )
        with inspect_kernels.lowering_for_hopper():
            return f.trace(*args, ex, jnp.int32(1)).lower(lowering_platforms=("cuda",)).as_text()

    def mosaic_operands(text):
        return [
            re.search(r"\}\s*:\s*\(([^)]*)\)", text[m.end() :]).group(1)
            for m in re.finditer(r"custom_call @mosaic_gpu_v2\(", text)
        ]

    plain, with_copy = lowered(kx), lowered(stored)
    P = -(-T * k // 8) * 8
    assert mosaic_operands(plain) == [
        f"tensor<{4 * E}xi32>, tensor<{P}x{D}xbf16>, tensor<{E}x{2 * I}x{D}xbf16>",
        f"tensor<{4 * E}xi32>, tensor<{P}x{I}xbf16>, tensor<{E}x{D}x{I}xbf16>",
    ]
    assert mosaic_operands(with_copy) == [
        f"tensor<{4 * E}xi32>, tensor<{P}x{D}xbf16>, tensor<{L * E}x{2 * I}x{D}xbf16>",
        f"tensor<{4 * E}xi32>, tensor<{P}x{I}xbf16>, tensor<{L * E}x{D}x{I}xbf16>",
    ]
    assert "mxfp4_dequantize" in plain and "mxfp4_dequantize" not in with_copy


def test_grouped_prefill_limits(monkeypatch):
    rng = np.random.default_rng(0)
    small = expert_format.prepare_experts(_experts(rng, 4, 128, 256, jnp.bfloat16))  # D: 2 K steps
    assert not moe_dense.grouped_fits(128, 256, 4, 512)
    big = expert_format.prepare_experts(_experts(rng, 4, 256, 256, jnp.bfloat16))
    assert moe_dense.grouped_fits(256, 256, 4, 128) and not moe_dense.grouped_fits(256, 256, 4, 127)
    x, idx, w = jnp.zeros((8, 256), jnp.bfloat16), jnp.zeros((8, 2), jnp.int32), jnp.ones((8, 2), jnp.float32)
    with pytest.raises(ValueError, match="16 pairs"):
        moe_dense.experts_grouped(x, idx, w, big, swiglu_limit=LIMIT, swiglu_alpha=ALPHA)
    # on Hopper the choice falls back to the Triton GEMMs where the shapes do not fit
    hopper = KernelConfig(impl="pallas").for_device(H200)
    assert choose("experts", 64, (256, 256, 4, 4), jnp.bfloat16, H200, hopper).kernel == "grouped"
    ran = []
    real = moe_dense.experts
    # (interpreted here: the config names a Hopper, for which the kernels are lowered uninterpreted)
    monkeypatch.setitem(
        pallas_kernels._EXPERTS, "dense", lambda *a, **kw: ran.append("dense") or real(*a, **{**kw, "interpret": True})
    )
    out = pallas_kernels.experts(  # 128 rows per expert: the dense GEMMs (`moe_dense_tile_rows`)
        jnp.ones((128, 128), jnp.bfloat16),
        jnp.zeros((128, 4), jnp.int32),
        jnp.full((128, 4), 0.25, jnp.float32),
        small,
        None,
        swiglu_limit=LIMIT,
        swiglu_alpha=ALPHA,
        kernels=hopper,
    )
    assert ran == ["dense"] and np.isfinite(np.asarray(out, np.float32)).all()


@pytest.mark.parametrize("device", [H200, CPU], ids=["hopper", "cpu"])
def test_prefill_regimes(device):
    """The regimes per token count; mid-batch bf16 takes the Mosaic kernels where they run (Hopper), as do
    prefills of up to 32 experts (the grouped GEMMs)."""

    def auto_config(T, k, E, dtype):
        return {"kernel": choose("experts", T, (2880, 2880, E, k), dtype, device, KERNELS).kernel}

    mid = "mosaic" if device.hopper else "mma"
    assert auto_config(1, 4, 32, jnp.bfloat16)["kernel"] == "gemv16"
    assert auto_config(256, 4, 32, jnp.bfloat16)["kernel"] == mid  # 32 rows per expert
    assert auto_config(8192, 4, 32, jnp.bfloat16)["kernel"] == ("grouped" if device.hopper else "dense")
    assert auto_config(8192, 4, 32, jnp.float32)["kernel"] == "dense"
    assert auto_config(32768, 4, 128, jnp.bfloat16)["kernel"] == ("grouped" if device.hopper else "dense")  # 120b
    assert auto_config(1024, 4, 128, jnp.bfloat16)["kernel"] == mid  # 32 rows per expert
    # 120b from 64 to 127 rows per expert: the fused kernel's 128-row tiles, not the half-empty dense ones
    tiles = choose("experts", 2048, (2880, 2880, 128, 4), jnp.bfloat16, device, KERNELS)
    assert (tiles.kernel, tiles.kw["block_m"]) == ("mma", 128)
    assert auto_config(4096, 4, 128, jnp.bfloat16)["kernel"] == ("grouped" if device.hopper else "dense")


def test_dispatch_slots_cover_every_pair_once():
    rng = np.random.default_rng(3)
    T, k, E, bm = 29, 4, 8, 16
    idx = jnp.asarray(np.stack([rng.permutation(E)[:k] for _ in range(T)]), jnp.int32)
    w = jnp.ones((T, k), jnp.float32)
    tok, _, order, se, ss, sr = moe_slots.dispatch(idx, w, E, bm)
    seen = np.zeros(T * k, int)
    e_sorted = np.asarray(idx).reshape(-1)[np.asarray(order)]
    for e, s, r in zip(np.asarray(se), np.asarray(ss), np.asarray(sr)):
        assert 0 <= r <= bm
        seen[s : s + r] += 1
        assert (e_sorted[s : s + r] == e).all()
    assert (seen == 1).all()


@pytest.mark.parametrize("P, ids, block", [(1, 3, 256), (37, 5, 8), (600, 33, 256), (1030, 129, 64)])
def test_stable_order_is_a_stable_argsort(P, ids, block):
    """Ranks by counting (the dispatch takes no sort) give argsort's stable order, every id present or not,
    P a multiple of the block or not."""
    e = jnp.asarray(np.random.default_rng(P).integers(0, ids, P), jnp.int32)
    want = np.argsort(np.asarray(e), kind="stable")
    np.testing.assert_array_equal(np.asarray(moe_slots.stable_order(e, ids, counting=True, block=block)), want)


def test_half_pairs_scaling_is_exact_and_in_range():
    """The f16 activation pairs: each token scaled by a power of two below 2^14, pairs (j, j + 4) in
    phase order, and the returned factor undoing scaling and decode exactly."""
    rng = np.random.default_rng(3)
    x = np.asarray(jnp.asarray(rng.normal(size=(3, 64)) * np.array([[1e-3], [1.0], [900.0]]), jnp.bfloat16), np.float32)
    x[1, 5] = 0.0
    words, factor = moe_gemv.half_pairs(jnp.asarray(x))
    halves = np.asarray(words).reshape(3, 4, 8).view(np.float16).reshape(3, 4, 8, 2).astype(np.float32)
    back = np.zeros_like(x)
    for j in range(4):
        for h in range(2):  # pair j holds features 8m + j (low half) and 8m + j + 4 (high half)
            back[:, 8 * np.arange(8) + j + 4 * h] = halves[:, j, :, h]
    scaled = back * np.asarray(factor)[:, None] / 2.0**14
    np.testing.assert_array_equal(scaled, x)
    assert np.abs(back).max() < 2.0**14 and (np.abs(back).max(axis=1) >= 2.0**13).all()


def test_activation_shift_bounds_clamped_swiglu():
    assert moe_gemv.activation_shift(7.0) == 8  # |a| <= 7 * 8 = 56 < 2^6
    g = jnp.linspace(-50, 50, 20001)
    a = moe_reference.swiglu(jnp.stack([g, g], -1).reshape(-1), 7.0, 1.702)
    assert float(jnp.max(jnp.abs(a))) * 2.0**8 < 2.0**14


def test_decode_config_choice():
    """bf16 takes the half-precision GEMV up to 2 rows per expert on average, fp32 never does."""

    def decode_config(T, k, E, half=False):  # where the Mosaic kernels do not run
        return {
            "kernel": choose(
                "experts", T, (2880, 2880, E, k), jnp.bfloat16 if half else jnp.float32, CPU, KERNELS
            ).kernel
        }

    assert decode_config(1, 4, 32, half=True)["kernel"] == "gemv16"
    assert decode_config(16, 4, 32, half=True)["kernel"] == "gemv16"
    assert decode_config(64, 4, 32, half=True)["kernel"] == "mma"
    assert decode_config(1, 4, 32)["kernel"] == "gemv"
    assert decode_config(16, 4, 32)["kernel"] == "mma"


@pytest.mark.parametrize(
    "cfg",
    [
        dict(kernel="gemv16", block_k=64, prefetch=True),
        dict(kernel="mma", block_m=16, block_n=16, block_n_down=16, block_k=64, num_stages=1),
    ],
)
def test_invalid_pairs_are_skipped_and_contribute_zero(cfg):
    """Pairs outside `valid_TK` cost no expert work and add exactly 0, even with a nonzero weight (their
    output rows are never written, so masking must not rely on weight 0)."""
    rng = np.random.default_rng(11)
    T, E, k, D, I = 6, 4, 2, 64, 64
    ex = _experts(rng, E, D, I, jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(0, E, (T, k)), jnp.int32)
    w = jnp.asarray(rng.random((T, k)), jnp.float32)
    valid = jnp.asarray(rng.random((T, k)) < 0.5).at[0].set(False)  # token 0 has no valid pair
    cfg = dict(cfg)
    kw = dict(swiglu_limit=LIMIT, swiglu_alpha=ALPHA, interpret=True, **cfg)
    kx = expert_format.prepare_experts(ex)
    out = pallas_kernels._EXPERTS[kw.pop("kernel")](x, idx, w, kx, None, valid, **kw)
    ref = moe_reference.apply_experts(x, idx, jnp.where(valid, w, 0.0), ex, swiglu_limit=LIMIT, swiglu_alpha=ALPHA)
    assert np.all(np.asarray(out[0], np.float32) == 0.0)
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("device", [H200, CPU], ids=["hopper", "cpu"])
def test_grouped_prefill_for_all_120b_experts(device):
    """`moe_grouped_experts` (128) sends the 120b prefill's dense GEMMs to the grouped ragged dot on Hopper, every
    expert dequantized at once, from `moe_dense_tile_rows` rows per expert; 32 keeps them on the Triton groups."""
    triton_groups = dataclasses.replace(KERNELS, moe_grouped_experts=32)

    def kernel(T, kernels):
        return choose("experts", T, (2880, 2880, 128, 4), jnp.bfloat16, device, kernels).kernel

    assert kernel(32768, triton_groups) == "dense"
    assert kernel(32768, KERNELS) == kernel(4096, KERNELS) == ("grouped" if device.hopper else "dense")
    assert kernel(2048, KERNELS) == kernel(2048, triton_groups) == "mma"  # 64 rows per expert: the fused 128-row tiles
