"""Sharding on 8 simulated CPU devices (conftest sets --xla_force_host_platform_device_count=8)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gptoss_jax import checkpoint
from pallas_kernels import KernelConfig, moe_reference
from sharding import expert_parallel
from sharding.rules import Layout, make_mesh

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")


def _layer_experts(params, layer):
    return jax.tree.map(lambda x: x[layer], params.layers.experts)


def _moe_case(small_checkpoint, model, seed=0):
    cfg, params = checkpoint.load_params(small_checkpoint, jnp.float32, progress=False)
    T = 24  # divisible by replicas * model for every case
    x = jax.random.normal(jax.random.PRNGKey(model + seed), (T, cfg.hidden_size), jnp.float32)
    kw = dict(top_k=cfg.experts_per_token, swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha)
    return cfg, params, x, kw


def _sharded_moe(layout, params, x, layer, kw, impl="reference"):
    experts = expert_parallel.pad_experts(params.layers.experts, layout.model_size)
    lp = jax.tree.map(lambda a: a[layer], params.layers)
    return jax.jit(lambda *a: expert_parallel.moe(*a, **kw, layout=layout, kernels=KernelConfig(impl=impl)))(
        x, lp.router_w, lp.router_b, experts, jnp.int32(layer)
    )


@pytest.mark.parametrize("dispatch", ["all_gather", "all_to_all"])
@pytest.mark.parametrize(
    "mode,model,replicas",
    [
        ("low_latency", 8, 1),
        ("max_throughput", 8, 1),
        ("low_latency", 4, 2),
        ("max_throughput", 2, 4),
        ("max_throughput", 3, 2),
    ],
)
def test_expert_parallel_moe_matches_single_device(small_checkpoint, mode, model, replicas, dispatch):
    cfg, params, x, kw = _moe_case(small_checkpoint, model)
    assert cfg.num_experts % model or model in (2, 4, 8)  # E=4: 8 and 3 need padding
    lp = jax.tree.map(lambda a: a[1], params.layers)
    ref = moe_reference.moe(x, lp.router_w, lp.router_b, lp.experts, **kw)
    padded = expert_parallel.pad_experts(params.layers.experts, model)
    assert padded.gate_up_blocks.shape[1] == expert_parallel.padded_count(cfg.num_experts, model)
    out = _sharded_moe(Layout(make_mesh(model, replicas), mode, dispatch), params, x, 1, kw)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_param_shardings_follow_the_table(small_checkpoint):
    cfg, params = checkpoint.load_params(small_checkpoint, jnp.float32, progress=False)
    ll = Layout(make_mesh(2, 4), "low_latency").param_shardings(cfg.num_kv_heads)
    assert ll.layers.q_w.spec == jax.sharding.PartitionSpec(None, "model", None)
    assert ll.layers.k_w.spec == jax.sharding.PartitionSpec(None, "model", None)  # 2 KV heads / 2
    assert ll.layers.experts.down_blocks.spec[1] == "model" and ll.unembed.spec[0] == "model"
    big = Layout(make_mesh(8, 1), "low_latency").param_shardings(cfg.num_kv_heads)
    # 2 KV heads < 8: no whole GQA group per device, so attention (q and o too) is replicated over `model`
    assert (
        big.layers.k_w.spec
        == big.layers.q_w.spec
        == big.layers.o_w.spec
        == jax.sharding.PartitionSpec(None, None, None)
    )
    assert big.layers.experts.down_blocks.spec[1] == "model"
    mt = Layout(make_mesh(8, 1), "max_throughput").param_shardings(cfg.num_kv_heads)
    assert mt.layers.q_w.spec == jax.sharding.PartitionSpec(None, None, None)
    with pytest.raises(ValueError, match="unknown parallelism mode"):
        Layout(make_mesh(2), "fastest")
    with pytest.raises(ValueError, match="unknown expert dispatch 'scatter'"):
        Layout(make_mesh(2), "max_throughput", "scatter")
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh(8, 2)


def test_bf16_experts_are_split_as_the_experts(monkeypatch):
    """The bf16 copy of the experts (`KernelConfig.moe_prefill_bf16_experts`) takes the experts' partition rule
    (`Layout.param_shardings`: layers whole, experts over `model`, padded): each device dequantizes its own experts
    into its share, bit for bit the single-device copy, and the expert-parallel MoE reading it (the grouped GEMMs
    on each device's 2 experts, interpreted) equals the one that dequantizes per call."""
    import dataclasses

    import pallas_kernels
    from gptoss_jax import config, random_weights

    P = jax.sharding.PartitionSpec
    hf = dict(random_weights.DEMO_CONFIG, vocab_size=512, hidden_size=256, intermediate_size=256, head_dim=64)
    cfg = config.from_hf_dict(dict(hf, num_local_experts=3))
    grouped = KernelConfig(impl="pallas", mosaic=True).for_device()  # the grouped GEMMs, interpreted on the CPU
    on = dataclasses.replace(grouped, moe_prefill_bf16_experts=True)
    params = random_weights.random_params(cfg, jnp.bfloat16, kernels=grouped)
    layout = Layout(make_mesh(2, 2), "max_throughput")
    sharded = layout.shard_params(params, cfg.num_kv_heads)
    stored = pallas_kernels.prepare_params(sharded, on)
    ex = stored.layers.experts
    assert ex.gu_bf16.shape[:2] == (cfg.num_layers, 4)  # 3 experts padded to 4
    assert ex.gu_bf16.sharding.spec == ex.dn_bf16.sharding.spec == P(None, "model")
    rules = layout.param_shardings(cfg.num_kv_heads, stored).layers.experts
    assert rules.gu_bf16.spec == rules.dn_bf16.spec == P(None, "model", None, None)
    one = pallas_kernels.with_bf16_experts(expert_parallel.pad_experts(params.layers.experts, 2), interpret=True)
    for a, b in ((ex.gu_bf16, one.gu_bf16), (ex.dn_bf16, one.dn_bf16)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
    seen = []
    real = pallas_kernels._EXPERTS["grouped"]

    def grouped_spy(x, idx, w, kexp, *a, **k):
        seen.append((kexp.gu_words.shape[1], kexp.gu_bf16 is not None))
        return real(x, idx, w, kexp, *a, **k)

    monkeypatch.setitem(pallas_kernels._EXPERTS, "grouped", grouped_spy)
    x = jax.random.normal(jax.random.PRNGKey(0), (192, cfg.hidden_size), jnp.bfloat16)  # 96 gathered per device
    lp = jax.tree.map(lambda a: a[1], stored.layers)
    kw = dict(top_k=cfg.experts_per_token, swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha)
    run = lambda experts: jax.jit(  # noqa: E731
        lambda *a: expert_parallel.moe(*a, **kw, layout=layout, kernels=grouped)
    )(x, lp.router_w, lp.router_b, experts, jnp.int32(1))
    plain = run(sharded.layers.experts)
    np.testing.assert_array_equal(np.asarray(run(ex)).view(np.uint16), np.asarray(plain).view(np.uint16))
    assert np.isfinite(np.asarray(plain, np.float32)).all()
    assert seen == [(2, False), (2, True)]  # each device's 2 experts on the grouped GEMMs, then with the copy


# ---- the whole engine on a mesh: logits and greedy tokens equal the single-device run ----------------

_PROMPTS = [[int(t) for t in np.random.default_rng(i).integers(2, 512, n)] for i, n in enumerate((40, 9, 23))]
_ENGINE = dict(
    dtype="float32",
    progress=False,
    min_context_bucket=64,
    max_num_seqs=8,
    decode_batch_buckets=(8,),
    prefill_chunk_size=64,
    min_prefill_bucket=64,
)  # few compiled shapes: the test stays short


@pytest.fixture(scope="module")
def single_device_run(small_checkpoint):
    from gptoss_jax import LLM, SamplingParams

    llm = LLM(small_checkpoint, **_ENGINE)
    sp = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[])
    return llm.logits(_PROMPTS[0]), [
        o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=_PROMPTS, sampling_params=sp, use_tqdm=False)
    ]


@pytest.mark.parametrize(
    "mode,model,replicas,generate,dispatch",
    [
        ("low_latency", 8, 1, False, "all_gather"),
        ("low_latency", 2, 4, True, "all_gather"),
        ("max_throughput", 8, 1, True, "all_gather"),
        ("max_throughput", 4, 2, False, "all_gather"),
        ("max_throughput", 3, 2, True, "all_gather"),
        # tokens replicated over `model` (low latency): nothing to dispatch, the option is accepted
        ("low_latency", 8, 1, False, "all_to_all"),
        ("max_throughput", 8, 1, True, "all_to_all"),
        ("max_throughput", 4, 2, False, "all_to_all"),
        ("max_throughput", 3, 2, True, "all_to_all"),
    ],
)
@pytest.mark.slow  # engines on simulated multi-device meshes
def test_sharded_engine_matches_single_device(
    small_checkpoint, single_device_run, mode, model, replicas, generate, dispatch
):
    """fp32, 4 experts over 8 or 3 devices (padded): logits to 1e-5 and 24 greedy tokens exactly."""
    from gptoss_jax import LLM, SamplingParams

    ref_logits, ref_tokens = single_device_run
    llm = LLM(
        small_checkpoint,
        model_parallel=model,
        replicas=replicas,
        parallel_mode=mode,
        expert_dispatch=dispatch,
        **_ENGINE,
    )
    layout = llm.engine.layout
    assert layout.dispatch == dispatch
    assert layout.mesh.devices.size == model * replicas and llm.engine.num_ranks == (
        replicas if mode == "low_latency" else model * replicas
    )
    assert llm.params.layers.experts.down_blocks.shape[1] == expert_parallel.padded_count(4, model)
    assert llm.engine.runner.cache.k_full.sharding.spec[1] == layout.batch_spec()[0]  # pages split over the ranks
    np.testing.assert_allclose(llm.logits(_PROMPTS[0]), ref_logits, rtol=1e-5, atol=1e-5 * np.abs(ref_logits).max())
    if generate:
        sp = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[])
        engine = llm.engine
        for i, p in enumerate(_PROMPTS):  # new sequences go to the least loaded rank
            engine.add_request(f"probe-{i}", p, sp)
        ranks = [c.seq.pages.rank for c in engine.scheduler.schedule().prefills]
        assert len(set(ranks)) == min(len(_PROMPTS), engine.num_ranks)
        for i in range(len(_PROMPTS)):
            engine.abort_request(f"probe-{i}")
        while engine.has_unfinished_requests():
            engine.step()
        outs = llm.generate(prompt_token_ids=_PROMPTS, sampling_params=sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref_tokens


@pytest.mark.parametrize(
    "mode,model,replicas,dispatch,generate",
    [("low_latency", 2, 4, "all_gather", False), ("max_throughput", 3, 2, "all_to_all", True)],
)
@pytest.mark.slow  # engines on simulated multi-device meshes
def test_kernels_under_a_layout_match_single_device(
    small_checkpoint, single_device_run, monkeypatch, mode, model, replicas, dispatch, generate
):
    """The kernels (interpreted on CPU) under a layout: every kernel is traced per device on its own shard
    (heads split in low latency, 4 experts padded to 6 over 3 devices, in the kernels' layout), and the
    logits and greedy tokens equal the single-device reference run. Interpreted kernels compile slowly:
    one case checks the prefill chunk only, the other adds decode steps."""
    import pallas_kernels
    from gptoss_jax import LLM, SamplingParams
    from pallas_kernels import KernelExperts, flash_attention, linear_decode, paged_attention

    seen = {}

    def spy(module, name, shape_of):
        real = getattr(module, name)

        def wrapped(*args, **kwargs):
            seen.setdefault(f"{module.__name__}.{name}", set()).add(shape_of(*args))
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapped)

    for kernel, real in dict(pallas_kernels._EXPERTS).items():  # every MoE kernel the choice may take

        def record(x, idx, w, kexp, *args, _real=real, _kernel=kernel, **kw):
            seen.setdefault(f"experts.{_kernel}", set()).add(kexp.gu_words.shape[:2])
            return _real(x, idx, w, kexp, *args, **kw)

        monkeypatch.setitem(pallas_kernels._EXPERTS, kernel, record)
    spy(linear_decode, "partial_sums", lambda x, ws, *_: tuple(w.shape[1] for w in ws))
    for kernel in (paged_attention, flash_attention):
        spy(kernel, "attention", lambda q, *_: q.shape[2])

    ref_logits, ref_tokens = single_device_run
    llm = LLM(
        small_checkpoint,
        impl="pallas",
        model_parallel=model,
        replicas=replicas,
        parallel_mode=mode,
        expert_dispatch=dispatch,
        **_ENGINE,
    )
    experts = llm.params.layers.experts
    assert isinstance(experts, KernelExperts)
    assert experts.gu_words.shape[1] == expert_parallel.padded_count(4, model)
    np.testing.assert_allclose(llm.logits(_PROMPTS[0]), ref_logits, rtol=1e-5, atol=1e-5 * np.abs(ref_logits).max())
    if generate:
        sp = SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[])
        out = llm.generate(prompt_token_ids=_PROMPTS[:1], sampling_params=sp, use_tqdm=False)
        assert out[0].outputs[0].token_ids == ref_tokens[0][:4]

    heads = 4 // model if mode == "low_latency" else 4  # 4 q heads, 2 KV heads: split over 2, whole over 3
    layers = llm.engine.model_config.num_layers
    moe_shapes = set().union(*(v for k, v in seen.items() if k.startswith("experts.")))
    assert moe_shapes == {(layers, 2)}  # stacked, 2 local experts
    assert seen["pallas_kernels.flash_attention.attention"] == {heads}
    assert seen.get("pallas_kernels.paged_attention.attention") == ({heads} if generate else None)
    # <= 64 rows take the projection kernel on the local shard (q and o local; k, v: 2 KV heads of 16 over the
    # split); up to 16 rows (decode) q, k and v share one launch, the 64-row prefill chunks launch each
    q, kv = 16 * heads, 16 * heads // 2
    assert seen["pallas_kernels.linear_decode.partial_sums"] == {(q,), (kv,), (64,)} | (
        {(q, kv, kv)} if generate else set()
    )


def test_sharded_loading_reads_each_slice(small_checkpoint):
    """`load_params_sharded` equals load + pad + device_put, leaf by leaf, with experts padded 4 -> 6."""
    layout = Layout(make_mesh(3, 2), "max_throughput")
    cfg, whole = checkpoint.load_params(small_checkpoint, jnp.float32, progress=False)
    want = layout.shard_params(whole, cfg.num_kv_heads)
    _, got = checkpoint.load_params_sharded(small_checkpoint, jnp.float32, layout, progress=False)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.shape == b.shape and a.dtype == b.dtype and a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    shard = got.layers.experts.down_blocks.addressable_shards[-1]
    assert shard.data.shape[1] == 2 and not np.asarray(shard.data).any()  # the last device: 2 zero experts
