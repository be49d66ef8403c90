"""The FP8 (e4m3) KV cache: the per-(token, head) quantization, its config names, the pages it buys, and the model
writing and reading it (the kernels' own FP8 tests are in test_kernels_attention.py, parity in test_parity.py)."""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from gptoss_jax import config, engine_config, kv_cache, model
from gptoss_jax.config import ConfigError
from gptoss_jax.random_weights import random_params
from pallas_kernels import kv_quant


def test_quantize_fills_e4m3_per_vector_and_round_trips():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 3, 64)) * 10.0 ** rng.uniform(-4, 4, size=(50, 3, 1))  # magnitudes 1e-4 .. 1e4
    x[7, 1] = 0.0
    q, scale = kv_quant.quantize(jnp.asarray(x, jnp.float32))
    assert q.dtype == kv_quant.FP8 and scale.shape == (50, 3)
    q32 = np.asarray(q, np.float32)
    amax = np.abs(q32).max(-1)
    assert np.all((amax == kv_quant.FP8_MAX) | (np.abs(x).max(-1) == 0))  # each vector's largest value -> 448
    assert np.asarray(scale)[7, 1] == 1.0 and not q32[7, 1].any()  # an all-zero vector stays exactly zero
    back = np.asarray(kv_quant.dequantize(q, scale))
    # e4m3 keeps 3 mantissa bits: normal values within 2^-4 relative; values 2^-9 of the max and below are subnormal
    err_bound = np.abs(x) * 2.0**-4 + np.abs(x).max(-1, keepdims=True) / kv_quant.FP8_MAX * 2.0**-9
    assert np.all(np.abs(back - x) <= err_bound * (1 + 1e-6))
    rel = np.linalg.norm(back - x, axis=-1) / np.maximum(np.linalg.norm(x, axis=-1), 1e-30)
    assert rel.max() < 0.05  # whatever a vector's magnitude: the scale is its own


def test_kv_cache_dtype_names():
    assert engine_config.load(None, kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    assert engine_config.load(None).kv_cache_dtype == "auto"
    with pytest.raises(ConfigError, match=r"kv_cache_dtype='fp8_e5m2'.*'auto', 'fp8', 'fp8_e4m3'"):
        engine_config.load(None, kv_cache_dtype="fp8_e5m2")


def test_fp8_pool_holds_nearly_twice_the_pages():
    """Same budget, 20b's shape: an FP8 value with its share of the scale takes 1 + 4/64 bytes against bf16's 2, so the
    full-layer pool gets nearly twice the pages."""
    cfg = config.preset("gpt-oss-20b")
    pages = {
        dtype: kv_cache.pool_sizes(
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
            kv_quant.value_bytes(dtype, cfg.head_dim),
            kv_cache.sliding_pool_pages(cfg.sliding_window, 16, 64, 2, 16384, 16),
            16,
            64 << 30,
            None,
        )[0]
        for dtype in (jnp.bfloat16, kv_quant.FP8)
    }
    # 2 / (1 + 4 / 64) = 1.88 per page; the sliding pool, a fixed share of the budget, shrinks too
    assert 1.88 < pages[kv_quant.FP8] / pages[jnp.bfloat16] < 2


def test_fp8_values_are_stored_transposed_within_a_page():
    """An FP8 cache keeps its values `[P, K, H, S]` (keys `[P, S, K, H]`; `kv_quant` says why): the value of (page,
    slot, KV head, dim) sits at [page, head, dim, slot], where the model's cache write puts it."""
    cfg = config.from_hf_dict(json.loads((Path(__file__).parent / "tiny_config.json").read_text()))
    K, H, S = cfg.num_kv_heads, cfg.head_dim, 4
    cache = model.PagedKVCache.zeros(cfg, 5, 7, S, kv_quant.FP8)
    assert cache.k_full.shape == (1, 7, S, K, H) and cache.v_full.shape == (1, 7, K, H, S)
    assert cache.v_sliding.shape == (1, 5, K, H, S) and cache.v_full_scale.shape == (1, 7, K, S)
    rng = np.random.default_rng(3)
    v_BTKH, _ = kv_quant.quantize(jnp.asarray(rng.normal(size=(2, 3, K, H)), jnp.float32))
    page, slot = np.array([[1, 1, 2], [4, 6, 6]]), np.array([[0, 3, 1], [2, 0, 3]])
    pools = model._write(cache.pools(False).flat(), (jnp.asarray(page), jnp.asarray(slot)), v_BTKH, v_BTKH)
    got, want = np.asarray(pools.v, np.float32), np.asarray(v_BTKH, np.float32)
    for b, t in np.ndindex(page.shape):
        np.testing.assert_array_equal(got[page[b, t], :, :, slot[b, t]], want[b, t])  # [K, H] of (page, slot)
        np.testing.assert_array_equal(np.asarray(pools.k, np.float32)[page[b, t], slot[b, t]], want[b, t])
    assert np.count_nonzero(got) == np.count_nonzero(want)  # nothing else written
    back = kv_quant.values_PSKH(pools.v)  # the keys' layout again, as the reference gathers it
    np.testing.assert_array_equal(np.asarray(back, np.float32), np.asarray(pools.k, np.float32))
    np.testing.assert_array_equal(np.asarray(kv_quant.values_PKHS(back), np.float32), got)


def test_forward_writes_and_reads_an_fp8_cache():
    """A prefill chunk then a decode step of the tiny model through both caches: the FP8 cache holds e4m3 values and
    a scale for every written (slot, head), and the hidden states stay close to the fp32 cache's."""
    cfg = config.from_hf_dict(json.loads((Path(__file__).parent / "tiny_config.json").read_text()))
    params = random_params(cfg, jnp.float32, seed=2)
    S, T = 4, 11
    table = jnp.asarray([[1, 2, 3, 4, 5]], jnp.int32)
    tables = model.PageTables(table, table, jnp.zeros((1,), jnp.int32))
    prompt = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, size=(1, T)), jnp.int32)
    hidden = {}
    for name, dtype in (("fp32", jnp.float32), ("fp8", kv_quant.FP8)):
        cache = model.PagedKVCache.zeros(cfg, 9, 9, S, dtype)
        _, cache, _ = model.forward(params, cache, prompt, jnp.arange(T, dtype=jnp.int32)[None], tables, cfg)
        hidden[name], cache, _ = model.forward(
            params, cache, jnp.asarray([[7]], jnp.int32), jnp.asarray([[T]], jnp.int32), tables, cfg
        )
        if name == "fp8":
            assert cache.k_full.dtype == kv_quant.FP8 and cache.k_full_scale.dtype == jnp.float32
            for kind in ("sliding", "full"):
                pools = cache.pools(kind == "sliding")
                scale_LPSK = np.swapaxes(np.asarray(pools.k_scale), -1, -2)
                written = scale_LPSK[:, 1:4].reshape(pools.k.shape[0], -1, cfg.num_kv_heads)[:, : T + 1]
                assert (written != 1.0).all()  # every written (slot, head) got its own scale
                assert np.abs(np.asarray(pools.k[:, 1:4], np.float32)).max() == kv_quant.FP8_MAX
                # values [L, P, K, H, S]: each written (slot, head) vector runs along H and fills e4m3's range
                amax_LPSK = np.swapaxes(np.abs(np.asarray(pools.v[:, 1:4], np.float32)).max(axis=3), -1, -2)
                assert (amax_LPSK.reshape(len(amax_LPSK), -1, cfg.num_kv_heads)[:, : T + 1] == kv_quant.FP8_MAX).all()
    a, b = (np.asarray(hidden[n], np.float64) for n in ("fp8", "fp32"))
    assert 0 < np.linalg.norm(a - b) / np.linalg.norm(b) < 0.1


@pytest.mark.slow  # engines on simulated 2-device meshes
@pytest.mark.parametrize("mode", ["low_latency", "max_throughput"])
def test_fp8_cache_sharded_like_its_pools(small_checkpoint, mode):
    """On a mesh the scales are split as their pools (KV heads over `model` in low latency, pages over the ranks in
    max throughput), and the logits are one device's."""
    from gptoss_jax import LLM

    ids = list(range(3, 40))
    one = LLM(small_checkpoint, dtype="float32", kv_cache_dtype="fp8", progress=False).logits(ids)
    llm = LLM(
        small_checkpoint, dtype="float32", kv_cache_dtype="fp8", progress=False, model_parallel=2, parallel_mode=mode
    )
    cache = llm.engine.runner.cache
    pool = cache.k_full.sharding.spec
    assert tuple(cache.k_full_scale.sharding.spec) == (*pool[:2], pool[3], pool[2])  # [layers, pages, kv_heads, slot]
    assert tuple(cache.v_full.sharding.spec) == (
        *pool[:2],
        pool[3],
        pool[4],
        pool[2],
    )  # [..., kv_heads, head_dim, slot]
    got = llm.logits(ids)
    assert np.linalg.norm(got - one) / np.linalg.norm(one) < 1e-5
