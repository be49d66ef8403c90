"""Random inputs shared by tools.check_kernels, tools.bench_kernels and tools.probe_moe_gemv (device-side
generation), and the half-precision MoE GEMV's launch as those tools spell it."""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import kv_quant
from pallas_kernels.choice import choose
from pallas_kernels.params import Experts

SHAPES = {"20b": dict(E=32, D=2880, I=2880, k=4), "120b": dict(E=128, D=2880, I=2880, k=4)}
LIMIT, ALPHA = 7.0, 1.702


def gemv16_launch(spec: str) -> dict:
    """BLOCK_N:BLOCK_K:WARPS:STAGES[:p] (p: the register double buffer) -> `moe_gemv.experts`' launch, one pair a
    program."""
    bn, bk, warps, stages, *p = spec.split(":")
    return dict(
        kernel="gemv16",
        block_m=1,
        block_n=int(bn),
        block_n_down=int(bn),
        block_k=int(bk),
        num_warps=int(warps),
        num_stages=int(stages),
        prefetch=p == ["p"],
        prefetch_down=p == ["p"],
    )


def experts(key, E, D, I, dtype=jnp.bfloat16):
    """Random MXFP4 experts with realistic E8M0 scales (2^-9 .. 2^-3)."""
    ks = jax.random.split(key, 6)
    u8 = lambda k, *s: jax.random.bits(k, s, jnp.uint8)  # noqa: E731
    sc = lambda k, *s: jax.random.randint(k, s, 118, 125, jnp.int32).astype(jnp.uint8)  # noqa: E731
    nrm = lambda k, *s: (jax.random.normal(k, s, jnp.float32) * 0.5).astype(dtype)  # noqa: E731
    return Experts(
        gate_up_blocks=u8(ks[0], E, 2 * I, D // 32, 16),
        gate_up_scales=sc(ks[1], E, 2 * I, D // 32),
        gate_up_bias=nrm(ks[2], E, 2 * I),
        down_blocks=u8(ks[3], E, D, I // 32, 16),
        down_scales=sc(ks[4], E, D, I // 32),
        down_bias=nrm(ks[5], E, D),
    )


def router(key, E, D, T, dtype=jnp.bfloat16, empty=()):
    k1, k2 = jax.random.split(key)
    x = (jax.random.normal(k1, (T, D), jnp.float32)).astype(dtype)
    rw = (jax.random.normal(k2, (E, D), jnp.float32) * 0.05).astype(dtype)
    rb = jnp.zeros((E,), jnp.float32).at[jnp.asarray(list(empty), jnp.int32)].set(-1e4).astype(dtype)
    return x, rw, rb


def paged(key, B, N, K, H, S, ctxs, sink_scale=1.0, dtype=jnp.bfloat16):
    """Random page pool, shuffled block tables, positions ctx-1 (ctx 0 -> padded row, pos -1)."""
    rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 2**30)))
    M = max(1, max((c + S - 1) // S for c in ctxs))
    P = B * M + 1
    ks = jax.random.split(key, 4)
    kp = jax.random.normal(ks[0], (P, S, K, H), jnp.float32).astype(dtype)
    vp = jax.random.normal(ks[1], (P, S, K, H), jnp.float32).astype(dtype)
    bt = jnp.asarray(rng.permutation(np.arange(1, P))[: B * M].reshape(B, M).astype(np.int32))
    pos = jnp.asarray(np.array(ctxs, np.int32)[:, None] - 1)
    q = jax.random.normal(ks[2], (B, 1, N, H), jnp.float32).astype(dtype)
    sinks = jax.random.normal(ks[3], (N,), jnp.float32) * sink_scale
    return q, kp, vp, bt, pos, sinks


def prefill(key, N, K, H, S, chunks, T, sink_scale=1.0, dtype=jnp.bfloat16):
    """Rows (start, length): queries at start .. start+length-1, then padding (pos -1) up to T; the pool
    holds keys 0 .. start+length-1 of each row behind a shuffled block table."""
    rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 2**30)))
    B = len(chunks)
    M = max((s + n + S - 1) // S for s, n in chunks) + 1
    P = B * M + 1
    ks = jax.random.split(key, 4)
    kp = jax.random.normal(ks[0], (P, S, K, H), jnp.float32).astype(dtype)
    vp = jax.random.normal(ks[1], (P, S, K, H), jnp.float32).astype(dtype)
    bt = jnp.asarray(rng.permutation(np.arange(1, P))[: B * M].reshape(B, M).astype(np.int32))
    pos = np.full((B, T), -1, np.int32)
    for b, (s, n) in enumerate(chunks):
        pos[b, :n] = np.arange(s, s + n)
    q = jax.random.normal(ks[2], (B, T, N, H), jnp.float32).astype(dtype)
    sinks = jax.random.normal(ks[3], (N,), jnp.float32) * sink_scale
    return q, kp, vp, bt, jnp.asarray(pos), sinks


def as_kv_cache(kp, vp, kv_cache_dtype: str) -> tuple:
    """Pools `[P, S, K, H]` as a cache of `kv_cache_dtype` stores them -> (k, v, the kernels' scale arguments, bytes
    per value); an FP8 cache's values `[P, K, H, S]`."""
    if kv_cache_dtype == "auto":
        return kp, vp, {}, kp.dtype.itemsize
    (kq, ks), (vq, vs) = kv_quant.quantize(kp), kv_quant.quantize(vp)
    scales = dict(k_scale_PKS=kv_quant.scales_PKS(ks), v_scale_PKS=kv_quant.scales_PKS(vs))
    return kq, kv_quant.values_PKHS(vq), scales, kv_quant.value_bytes(kq.dtype, kp.shape[-1])


def decode_launch(kernels, kv_cache_dtype: str) -> dict:
    """The decode attention launch `kernels` (resolved for a device) takes at 64 rows over a cache of `kv_cache_dtype`
    (FP8: `attention_fp8_*`): block_kv, num_stages, num_warps."""
    c = choose(
        "attention", 64, (1, 64, 8, 64), kv_quant.DTYPES[kv_cache_dtype] or jnp.bfloat16, kernels.device, kernels
    )
    return {k: c.kw[k] for k in ("block_kv", "num_stages", "num_warps")}
