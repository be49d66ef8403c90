"""Page pools, prefix-cache bookkeeping, sliding-window release, and engine config files."""

import pytest

from gptoss_jax import engine_config
from gptoss_jax.config import ConfigError
from gptoss_jax.kv_cache import KVCacheManager, OutOfPages, PagePool, SequencePages


def test_pool_refcounts_and_lru_eviction():
    pool = PagePool(4, enable_prefix_caching=True)  # pages 1..3
    a, b, _ = pool.allocate(), pool.allocate(), pool.allocate()
    with pytest.raises(OutOfPages):
        pool.allocate()
    pool.register(a, 111)
    pool.share(a)
    pool.release(a)
    assert pool.num_available == 0  # still referenced once
    pool.release(a)
    assert pool.num_available == 1 and pool.lookup(111) == a  # evictable, still hashed
    pool.share(a)  # revived by a prefix hit
    assert pool.num_available == 0
    pool.release(a)
    pool.release(b)
    assert pool.allocate() == b  # truly free pages go first
    assert pool.allocate() == a and pool.lookup(111) is None  # then the LRU evictable one


def test_sliding_pages_stay_bounded_and_full_pages_grow():
    kv = KVCacheManager(
        num_pages_full=64, num_pages_sliding=8, page_size=4, window=8, num_sliding_layers=1, enable_prefix_caching=False
    )
    pages = SequencePages()
    for pos in range(100):
        kv.allocate(pages, pos, pos + 1)
        kv.slide(pages, pos + 1)
        live = [p for p in pages.sliding if p]
        assert len(live) <= 3  # ceil((8 - 1 + 1) / 4) + 1
    assert len(pages.full) == 25 and pages.sliding[:20] == [0] * 20
    kv.free(pages)
    assert kv.full.num_used == 0 and kv.sliding.num_used == 0


def test_prefix_match_shares_full_pages():
    kv = KVCacheManager(32, 16, page_size=4, window=4, num_sliding_layers=2, enable_prefix_caching=True)
    first = SequencePages()
    tokens = list(range(20))
    kv.allocate(first, 0, 20)
    kv.register(first, tokens, 20)
    second = SequencePages()
    start, hit = kv.match_prefix(second, tokens[:18] + [99, 98])
    assert hit == 16 and start == 16 - 2 * 3 and second.full == first.full[:4]
    kv.free(first)
    assert kv.full.num_used == 4  # still held by the second sequence
    assert kv.match_prefix(SequencePages(), [7] * 20) == (0, 0)


def test_a_kernels_override_keeps_the_profiles_other_kernel_settings():
    """Both profiles store the 20b's experts in bf16 for its prefill GEMMs; overriding another kernel setting
    (`--set 'kernels={...}'`, `LLM(kernels=...)`) must not drop it, and the override can turn it off."""
    assert engine_config.load("max_throughput").kernels.moe_prefill_bf16_experts
    assert engine_config.load("low_latency").kernels.moe_prefill_bf16_experts
    assert not engine_config.load(None).kernels.moe_prefill_bf16_experts  # no profile: KernelConfig's default
    cfg = engine_config.load("max_throughput", kernels={"moe_route_max_tokens": 0})
    assert cfg.kernels.moe_prefill_bf16_experts and cfg.kernels.moe_route_max_tokens == 0
    off = engine_config.load("max_throughput", kernels={"moe_prefill_bf16_experts": False})
    assert not off.kernels.moe_prefill_bf16_experts


def test_profiles_load_and_bad_keys_are_named(tmp_path):
    for name in ("low_latency", "max_throughput"):
        cfg = engine_config.load(name)
        assert cfg.warmup and cfg.max_num_seqs >= 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_num_seqs: 4\nmax_num_seq: 8\n")
    with pytest.raises(
        ConfigError, match=r"bad.yaml: unknown engine setting 'max_num_seq' \(did you mean 'max_num_seqs'"
    ):
        engine_config.load(bad)
    bad.write_text("gpu_memory_utilization: 1.5\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: .*gpu_memory_utilization=1.5"):
        engine_config.load(bad)
    bad.write_text("kv_cache_memory_fraction: 0.9\n")  # renamed, and its meaning changed: the error says so
    with pytest.raises(ConfigError, match=r"bad.yaml: 'kv_cache_memory_fraction' is now 'gpu_memory_utilization'"):
        engine_config.load(bad)
    bad.write_text("zzz: 1\n")
    with pytest.raises(ConfigError, match=r"unknown engine setting 'zzz' \(known: "):
        engine_config.load(bad)
    with pytest.raises(ConfigError, match="profiles"):
        engine_config.load("no_such_profile")
    bad.write_text("expert_dispatch: all_reduce\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: .*expert_dispatch='all_reduce': 'all_gather' or 'all_to_all'"):
        engine_config.load(bad)


def test_buckets():
    cfg = engine_config.EngineConfig(max_num_seqs=48, prefill_chunk_size=512, page_size=16, min_context_bucket=1024)
    assert cfg.decode_buckets() == (1, 2, 4, 8, 16, 32, 48)
    assert cfg.prefill_token_buckets() == (16, 32, 64, 128, 256, 512)
    assert cfg.context_buckets(4096) == (64, 128, 256)


def test_gpu_memory_utilization_is_a_fraction_of_the_whole_device(monkeypatch):
    """vLLM's meaning: the engine holds `gpu_memory_utilization` of the whole device (weights + KV cache +
    activations), so the cache gets that less what is in use and the activation reserve; clamped to JAX's pool."""
    import dataclasses
    from types import SimpleNamespace

    import jax.numpy as jnp

    from gptoss_jax import config, kv_cache
    from gptoss_jax.runner import ModelRunner

    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    GiB = 2**30
    total, weights = 140 * GiB, 13 * GiB
    stats = {"bytes_limit": int(0.92 * total), "bytes_in_use": weights}
    mc, ec = config.preset("gpt-oss-20b"), engine_config.load("max_throughput")
    reserve = kv_cache.activation_bytes(mc, ec, 2)
    assert 2 * GiB < reserve < 30 * GiB  # the 16,384-token prefill steps of this profile

    def budget(stored=False, in_use=weights, **kw):
        experts = SimpleNamespace(gu_bf16=jnp.zeros((2, 4, 8, 4), jnp.bfloat16) if stored else None)
        params = SimpleNamespace(layers=SimpleNamespace(experts=experts))
        runner = SimpleNamespace(
            model_config=mc, config=dataclasses.replace(ec, **kw), dtype=jnp.bfloat16, params=params
        )
        return ModelRunner._kv_budget(runner, {**stats, "bytes_in_use": in_use})

    assert abs(budget() - (0.9 * total - weights - reserve)) < 1024
    assert abs(budget() - budget(gpu_memory_utilization=0.5) - 0.4 * total) < 1024  # the whole device's 40%
    assert abs(budget(gpu_memory_utilization=1.0) - (0.92 * total - weights - reserve)) < 1024  # the pool's limit
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.1 .* leaves nothing for the KV cache"):
        budget(gpu_memory_utilization=0.1)
    # A bf16 copy of the experts (`KernelConfig.moe_prefill_bf16_experts`: 38.2 GB for 20b) is in use like the
    # weights, and the layer that each prefill call dequantized leaves the reserve.
    copy = 3 * mc.num_layers * mc.num_experts * mc.hidden_size * mc.intermediate_size * 2
    dequantized = 1.25 * 3 * mc.num_experts * mc.hidden_size * mc.intermediate_size * 2  # in the reserve's 1.25x
    assert abs(copy / 1e9 - 38.2) < 0.1
    assert abs(reserve - kv_cache.activation_bytes(mc, ec, 2, dequantizes=False) - dequantized) <= 1
    assert abs(budget(stored=True, in_use=weights + copy) - (budget() - copy + dequantized)) < 1024
    with pytest.raises(ValueError, match=r"of which the experts' bf16 copy.*turn kernels.moe_prefill_bf16_experts off"):
        budget(stored=True, in_use=weights + copy, gpu_memory_utilization=0.3)
    # the smaller steps of low_latency reserve less
    assert kv_cache.activation_bytes(mc, engine_config.load("low_latency"), 2) < reserve
