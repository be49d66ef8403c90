"""GPU correctness of the Pallas kernels against the pure-JAX references on fresh random inputs.

    python -m tools.check_kernels [--seed N]

Prints one row per case: kernel, shape, relative L2 error vs reference, finite, pass (< 2e-2; both
sides are bf16 so ~1e-3..5e-3 is expected). MoE cases run the kernel `choice.choose` picks for their rows on
this GPU (`auto`), or on it without the Mosaic GPU kernels (`triton`), with some launch settings replaced.
"""

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from gptoss_jax import runtime
from pallas_kernels import (
    KernelConfig,
    attention_reference,
    expert_format,
    flash_attention,
    linear_decode,
    linear_mosaic,
    moe_dense,
    moe_reference,
    paged_attention,
    ragged_dot,
)
from pallas_kernels.choice import Device, choose
from tools import kernel_cases as kc

TOL = 2e-2


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)), bool(np.isfinite(a).all())


def check_linear_many(key):
    """Fused q/k/v projection (one launch) at the attention shapes, [4096, 512, 512] x 2880 in both models
    (64 query and 8 KV heads of 64), reading the last of 24 (20b) or 36 (120b) stacked layers: each output
    vs the reference on its own weight."""
    rows = []
    for model, L in (("20b", 24), ("120b", 36)):
        for T in (1, 4):
            key, kx, kw, kb = jax.random.split(key, 4)
            x = jax.random.normal(kx, (T, 2880), jnp.float32).astype(jnp.bfloat16)
            ws = tuple(
                (jax.random.normal(k, (L, O, 2880), jnp.float32) * 0.02).astype(jnp.bfloat16)
                for k, O in zip(jax.random.split(kw, 3), (4096, 512, 512))
            )
            bs = tuple(
                jax.random.normal(k, (w.shape[1],), jnp.float32).astype(jnp.bfloat16)
                for k, w in zip(jax.random.split(kb, 3), ws)
            )
            got = linear_decode.linear_many(x, ws, bs, jnp.int32(L - 1))
            for name, y, w, b in zip("qkv", got, ws, bs):
                e, fin = rel(y, linear_decode.reference(x, w, b, L - 1))
                rows.append(
                    (
                        f"linear_many {name}",
                        f"{model} T={T} O={w.shape[1]} K=2880 fused qkv, layer {L - 1} of {L}",
                        e,
                        fin,
                    )
                )
                print(*rows[-1], flush=True)
            del ws
    return rows


def new_token_case(key, B, bt, pos_B, S, N=64, K=8, H=64, L=24):
    """Split-K partial sums (3 splits), layer-stacked biases, RoPE factors and write targets for
    `attention_new_token` at the gpt-oss attention shapes, layer L - 1."""
    ks = jax.random.split(key, 7)
    parts = tuple(jax.random.normal(k, (3, B, n * H), jnp.float32) for k, n in zip(ks[:3], (N, K, K)))
    biases = tuple(
        jax.random.normal(k, (L, n * H), jnp.float32).astype(jnp.bfloat16) for k, n in zip(ks[3:6], (N, K, K))
    )
    angle = jax.random.uniform(ks[6], (B, H // 2), jnp.float32, 0, 6.3)
    col = jnp.maximum(pos_B, 0) // S
    page = jnp.where(pos_B >= 0, jnp.take_along_axis(bt, col[:, None], 1)[:, 0], 0)
    return (
        parts,
        biases,
        jnp.int32(L - 1),
        jnp.cos(angle).astype(jnp.bfloat16),
        jnp.sin(angle).astype(jnp.bfloat16),
        page,
        jnp.maximum(pos_B, 0) % S,
    )


def check_linear_mosaic(key):
    """The Mosaic projection kernel (Hopper): fused q/k/v and the o projection at the gpt-oss shapes, the last of
    24 stacked layers, row counts from 1 to 256 (ragged ones included), plus a weight whose rows end inside a CTA's
    tile and inside a warpgroup's, with the configuration `linear_mosaic.config` picks and a forced K split."""
    rows = []
    cases = [(T, (4096, 512, 512), 2880) for T in (1, 5, 64, 100, 256)]
    cases += [(T, (2880,), 4096) for T in (1, 64, 256)] + [(37, (200, 64), 640)]
    for T, Os, K in cases:
        for cfg in (
            linear_mosaic.config(T, K, Os, Device.current().num_sms),
            dict(splits=K // linear_mosaic.TILE_K, stages=2),
        ):
            key, kx, kw, kb = jax.random.split(key, 4)
            L = 24
            x = jax.random.normal(kx, (T, K), jnp.float32).astype(jnp.bfloat16)
            ws = tuple(
                (jax.random.normal(k, (L, O, K), jnp.float32) * 0.02).astype(jnp.bfloat16)
                for k, O in zip(jax.random.split(kw, len(Os)), Os)
            )
            bs = tuple(
                jax.random.normal(k, (O,), jnp.float32).astype(jnp.bfloat16)
                for k, O in zip(jax.random.split(kb, len(Os)), Os)
            )
            got = linear_mosaic.linear_many(x, ws, bs, jnp.int32(L - 1), **cfg)
            for y, w, b in zip(got, ws, bs):
                e, fin = rel(y, linear_decode.reference(x, w, b, L - 1))
                rows.append(("linear_mosaic", f"T={T} O={w.shape[1]} K={K} of {len(Os)} weights {cfg}", e, fin))
                print(*rows[-1], flush=True)
            del ws
    return rows


def check_swiglu_epilogue(key):
    """The grouped path's gate/up epilogue kernel against the XLA expression it replaced (20b shapes, rows sorted
    by expert with empty experts, values past the clamp): equal up to f32 rounding order and the GPU's exp."""
    rows = []
    s = kc.SHAPES["20b"]
    E, I = s["E"], s["I"]
    for P in (777 * 4, 4099 * 4, 16384 * 4):
        key, k1, k2, k3 = jax.random.split(key, 4)
        z = (jax.random.normal(k1, (P, 2 * I), jnp.float32) * 2.0**-12).astype(jnp.bfloat16)  # x 2^14: sd 4
        e = jnp.sort(jax.random.choice(k2, jnp.arange(1, E - 1, 2, dtype=jnp.int32), (P,)))
        bias = jax.random.normal(k3, (E, 2, I), jnp.float32).astype(jnp.bfloat16)
        got = moe_dense.swiglu_epilogue(z, e, bias, limit=kc.LIMIT, alpha=kc.ALPHA)
        want = moe_dense.swiglu_epilogue_reference(z, e, bias, limit=kc.LIMIT, alpha=kc.ALPHA)
        e_, fin = rel(got, want)
        rows.append(("swiglu_epilogue", f"20b P={P} even experts and the last empty, vs XLA", e_, fin))
        print(*rows[-1], flush=True)
    return rows


def check_bf16_experts(key):
    """`KernelConfig.moe_prefill_bf16_experts` (Hopper): the grouped path reading the stored bf16 copy in place (the
    whole stack of 3 layers, layer 1 traced) against the same call dequantizing per call, 20b shapes: must be
    bit-identical (the row's error is their difference; `finite` also requires every bit equal)."""
    rows = []
    s = kc.SHAPES["20b"]
    key, k0 = jax.random.split(key)
    layers = [kc.experts(k, s["E"], s["D"], s["I"]) for k in jax.random.split(k0, 3)]
    kx = jax.jit(expert_format.prepare_experts)(jax.tree.map(lambda *a: jnp.stack(a), *layers))
    stored = pallas_kernels.with_bf16_experts(kx)
    for T, empty in ((777, (2, 9)), (4099, (0, 5, 31))):
        key, k1 = jax.random.split(key)
        x, rw, rb = kc.router(k1, s["E"], s["D"], T, empty=empty)
        idx, w, _ = moe_reference.route(x, rw, rb, s["k"])
        run = lambda ex: moe_dense.experts_grouped(  # noqa: E731
            x, idx, w, ex, jnp.int32(1), swiglu_limit=kc.LIMIT, swiglu_alpha=kc.ALPHA
        )
        got, want = np.asarray(run(stored), np.float32), np.asarray(run(kx), np.float32)
        e_, fin = rel(got, want)
        same = bool(np.array_equal(got, want))
        rows.append(
            ("bf16_experts", f"20b T={T} empty={list(empty)} layer 1 of 3, bit-identical={same}", e_, fin and same)
        )
        print(*rows[-1], flush=True)
    return rows


def check_ragged_dot(key):
    """`pallas_kernels.ragged_dot` (Hopper) against `lax.ragged_dot` on groups 8..15 of a stack of 24, with empty
    groups, groups spanning several row blocks, rows past the groups, and the 20b expert shapes; and against jax's
    own Mosaic ragged dot on the sliced groups (same blocks along K: expected bit-identical)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    rows = []
    for N, K, sizes in (
        (384, 256, (0, 300, 1, 0, 129, 7, 0, 40)),
        (5760, 2880, (512, 0, 3, 130, 1000, 2, 255, 98)),
        (2880, 2880, (0, 0, 0, 0, 0, 0, 0, 777)),
    ):
        key, k1, k2 = jax.random.split(key, 3)
        M = -(-(sum(sizes) + 5) // 8) * 8
        x = jax.random.normal(k1, (M, K), jnp.float32).astype(jnp.bfloat16)
        w = jax.random.normal(k2, (24, N, K), jnp.float32).astype(jnp.bfloat16)
        g = jnp.asarray(sizes, jnp.int32)
        bn = next(b for b in (192, 128) if N % b == 0)
        got = jax.jit(functools.partial(ragged_dot.ragged_dot, block_n=bn))(x, w, jnp.int32(8), g)
        P = sum(sizes)
        want = ragged_dot.ragged_dot_reference(x, w, 8, g)
        e_, fin = rel(np.asarray(got[:P], np.float32), np.asarray(want[:P], np.float32))
        rows.append(("ragged_dot", f"N={N} K={K} groups 8..15 of 24 sizes={list(sizes)}", e_, fin and e_ < TOL))
        print(*rows[-1], flush=True)
        jaxs = ragged_dot_mgpu.ragged_dot(
            x,
            w[8:16],
            group_sizes=g,
            block_m=128,
            block_n=bn,
            block_k=64,
            max_concurrent_steps=4,
            grid_block_n=1,
            transpose_rhs=True,
        )
        same = bool(np.array_equal(np.asarray(got[:P]), np.asarray(jaxs[:P])))
        rows.append(("ragged_dot", f"N={N} K={K} against jax's ragged dot, bit-identical={same}", 0.0, same))
        print(*rows[-1], flush=True)
    return rows


def moe(kernels: KernelConfig, **override):
    """`moe_reference.moe`'s signature on the kernels: routing, then the experts on the kernel `kernels` chooses for
    the rows, with `override` replacing the kernel or launch settings it names -> (out, kernel that ran)."""

    def run(x, rw, rb, kexp, *, top_k, swiglu_limit, swiglu_alpha):
        idx, w, _ = moe_reference.route(x, rw, rb, top_k)
        D, I, E = x.shape[1], kexp.gu_words.shape[-2], rw.shape[0]
        c = choose("experts", x.shape[0], (D, I, E, top_k), x.dtype, kernels.device, kernels)
        launch = c.kw | override
        kernel = launch.pop("kernel", c.kernel)
        return pallas_kernels._EXPERTS[kernel](
            x, idx, w, kexp, swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha, **launch
        ), kernel

    return run


def main():
    runtime.prepare()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--only", default="", help="comma-separated prefixes of the case names to run (default: all)")
    args = ap.parse_args()
    prefixes = tuple(p for p in args.only.split(",") if p)

    def want(name: str) -> bool:
        return not prefixes or name.startswith(prefixes)

    key = jax.random.PRNGKey(args.seed)
    rows = []
    print(f"device: {jax.devices()[0].device_kind}  seed {args.seed}")

    # the kernel the engine would run on this GPU, and the Pallas-Triton kernels alone
    auto, triton = (KernelConfig(impl="pallas", mosaic=m).for_device() for m in (None, False))
    groups = KernelConfig(impl="pallas", moe_grouped_experts=32).for_device()  # 120b on the Triton GEMMs
    for name, (model, T, empty, fn) in {
        "moe_decode": ("20b", 1, (), moe(triton)),
        "moe_decode ": ("20b", 3, (0, 5), moe(triton)),
        "moe_decode  ": ("20b", 17, (1,), moe(triton)),
        "moe_decode   ": ("120b", 5, (7,), moe(triton)),
        "moe_decode nopf": ("120b", 2, (), moe(triton, prefetch=False, block_k=256)),
        "moe_decode gemv f32": ("20b", 2, (4,), moe(triton, kernel="gemv", block_m=1)),
        "moe_decode gemv f32 bm2": ("120b", 9, (), moe(triton, kernel="gemv", block_m=2, prefetch=False)),
        "moe_decode gemv16": ("20b", 1, (), moe(triton, kernel="gemv16", block_m=1)),
        "moe_decode gemv16 ": ("20b", 17, (1,), moe(triton, kernel="gemv16", block_m=1)),
        "moe_decode gemv16  ": ("120b", 5, (7,), moe(triton, kernel="gemv16", block_m=1, block_k=256, prefetch=False)),
        "moe_decode gemv16 bm4": ("20b", 40, (3,), moe(triton, kernel="gemv16", block_m=4, block_k=512)),
        "moe_decode gemv16 bm2": (
            "120b",
            33,
            (),
            moe(triton, kernel="gemv16", block_m=2, block_k=1024, prefetch=False),
        ),
        "moe_prefill": ("20b", 777, (2, 9), moe(auto)),  # 97 rows per expert: grouped GEMMs on Hopper
        "moe_prefill  ": ("20b", 4099, (0, 5, 31), moe(auto)),  # grouped, first and last expert empty
        "moe_prefill dense 20b": ("20b", 777, (2, 9), moe(auto, kernel="dense")),
        "moe_prefill ": ("120b", 1001, (), moe(auto)),  # 31 rows per expert: Mosaic on Hopper
        "moe_prefill mma": ("120b", 1001, (), moe(triton, kernel="mma")),  # the Triton fused mma kernels, same size
        "moe_prefill tiles": ("120b", 2305, (4, 100), moe(auto)),  # 72 rows per expert: mma's 128-row tiles
        "moe_prefill dense": ("120b", 4099, (4, 100), moe(groups)),  # 4 expert groups, 128 rows per expert: dense
        "moe_prefill grouped 120b": ("120b", 4099, (0, 100, 127), moe(auto)),  # all 128 at once: grouped on Hopper
        # Mosaic GPU mid-batch kernels (picked on Hopper from 2 to 32 rows per expert)
        "moe_mosaic": ("20b", 64, (3,), moe(auto)),  # 8 rows per expert: 16-row slots
        "moe_mosaic ": ("120b", 333, (5,), moe(auto)),  # 10.4 rows per expert: 32-row slots
        "moe_mosaic bm8": ("20b", 100, (), moe(auto, kernel="mosaic", block_m=8, stages=3)),  # experts in several slots
    }.items():
        if not want(name):
            continue
        s = kc.SHAPES[model]
        key, k1, k2 = jax.random.split(key, 3)
        ex = kc.experts(k1, s["E"], s["D"], s["I"])
        x, rw, rb = kc.router(k2, s["E"], s["D"], T, empty=empty)
        ref = moe_reference.moe(x, rw, rb, ex, top_k=s["k"], swiglu_limit=kc.LIMIT, swiglu_alpha=kc.ALPHA)
        kx = jax.jit(expert_format.prepare_experts)(ex)
        out, kernel = fn(x, rw, rb, kx, top_k=s["k"], swiglu_limit=kc.LIMIT, swiglu_alpha=kc.ALPHA)
        e, fin = rel(out, ref)
        rows.append((name.strip(), f"{model} T={T} empty={list(empty)} {kernel}", e, fin))
        print(*rows[-1], flush=True)
        del ex, kx

    if want("swiglu_epilogue"):
        rows += check_swiglu_epilogue(key)
    if want("ragged_dot") and Device.current().hopper:
        rows += check_ragged_dot(key)
    if want("bf16_experts") and Device.current().hopper:
        rows += check_bf16_experts(key)

    decode_launch = functools.partial(kc.decode_launch, auto)  # the engine's, per cache dtype
    default_launch = dict(block_kv=64, num_stages=3, num_warps=4)
    for name, (B, S, ctxs, window, sink_scale, splits, kv, launch) in {
        "paged_decode": (5, 16, [5, 127, 128, 4097, 0], 128, 20.0, None, "auto", decode_launch("auto")),
        "paged_decode ": (2, 64, [8191, 70], 2**31 - 1, 5.0, None, "auto", decode_launch("auto")),
        "paged_decode fp8": (5, 16, [5, 127, 128, 4097, 0], 128, 20.0, None, "fp8", decode_launch("fp8")),
        "paged_decode fp8 ": (2, 64, [8191, 70], 2**31 - 1, 5.0, None, "fp8", decode_launch("fp8")),
        "paged_decode fp8  ": (3, 16, [4000, 17, 1], 2**31 - 1, 5.0, 4, "fp8", default_launch),
    }.items():
        if not want(name):
            continue
        key, k1 = jax.random.split(key)
        q, kp, vp, bt, pos, sinks = kc.paged(k1, B, 64, 8, 64, S, ctxs, sink_scale)
        kp, vp, scales, _ = kc.as_kv_cache(kp, vp, kv)
        ref = attention_reference.attention(q, kp, vp, bt, pos, sinks, window, **scales)
        out = paged_attention.attention(q, kp, vp, bt, pos, sinks, window, **scales, num_splits=splits, **launch)
        e, fin = rel(out, ref)
        rows.append(
            (
                name.strip(),
                f"kv={kv} B={B} page={S} ctx={ctxs} win={'full' if window > 2**30 else window} "
                f"sinks*{sink_scale} splits={splits} {'/'.join(map(str, launch.values()))}",
                e,
                fin,
            )
        )
        print(*rows[-1], flush=True)

    # (rows, page size, contexts, window, sink scale, KV dtype, launch, tokens a row: a verify step's k + 1 end at
    # the row's context, each attending to the cache and the row's earlier new tokens)
    for name, (B, S, ctxs, window, sink_scale, kv, launch, T) in {
        "paged_decode_new_token": (1, 16, [1000], 2**31 - 1, 1.0, "auto", decode_launch("auto"), 1),
        "paged_decode_new_token ": (6, 16, [1, 129, 300, 8191, 0, 17], 128, 20.0, "auto", decode_launch("auto"), 1),
        "paged_decode_new_token fp8": (1, 16, [1000], 2**31 - 1, 1.0, "fp8", decode_launch("fp8"), 1),
        "paged_decode_new_token fp8 ": (6, 16, [1, 129, 300, 8191, 0, 17], 128, 20.0, "fp8", decode_launch("fp8"), 1),
        "paged_decode_new_token fp8  ": (6, 16, [1, 129, 300, 8191, 0, 17], 128, 20.0, "fp8", default_launch, 1),
        "paged_decode_new_token rows": (2, 16, [1000, 8191], 2**31 - 1, 1.0, "auto", decode_launch("auto"), 4),
        "paged_decode_new_token rows ": (4, 16, [8, 129, 0, 300], 128, 20.0, "auto", decode_launch("auto"), 8),
        "paged_decode_new_token rows fp8": (4, 16, [4, 129, 0, 8191], 128, 20.0, "fp8", decode_launch("fp8"), 4),
    }.items():
        if not want(name):
            continue
        key, k1, k2 = jax.random.split(key, 3)
        _, kp, vp, bt, pos, sinks = kc.paged(k1, B, 64, 8, 64, S, ctxs, sink_scale)
        kp, vp, scales, _ = kc.as_kv_cache(kp, vp, kv)
        pos = jnp.where(pos >= 0, pos - T + 1 + jnp.arange(T)[None, :], -1).reshape(-1)  # [B * T]
        args = new_token_case(k2, B * T, jnp.repeat(bt, T, axis=0), pos, S)
        sinks = jnp.concatenate([jnp.full((args[2], sinks.shape[0]), -3.0), sinks[None]])  # the case's layer's
        rows_kw = dict(tokens_per_row=T)
        ref, *ref_cache = paged_attention.new_token_reference(
            *args[:3], *args[3:5], kp, vp, bt, 0, pos, *args[5:], sinks, window, **scales, **rows_kw
        )
        out, got_k, got_v, _, *got_scales = paged_attention.attention_new_token(
            *args[:3], *args[3:5], kp, vp, bt, 0, pos, *args[5:], sinks, window, **scales, **launch, **rows_kw
        )
        e, fin = rel(out, ref)
        # the k and v pools and their scales; page 0, the null page, is where the reference writes padding rows
        ek = max(
            rel(got[1:].astype(jnp.float32), want[1:].astype(jnp.float32))[0]
            for got, want in zip((got_k, got_v, *got_scales), ref_cache)
            if want is not None
        )
        rows.append(
            (
                name.strip(),
                f"kv={kv} B={B} T={T} ctx={ctxs} win={'full' if window > 2**30 else window} sinks*{sink_scale} "
                f"{'/'.join(map(str, launch.values()))} cache err {ek:.1e}",
                max(e, ek),
                fin,
            )
        )
        print(*rows[-1], flush=True)

    for name, (chunks, T, window, sink_scale, cfg, kv) in {
        "flash_prefill": ([(0, 300), (100, 77), (0, 0)], 300, 2**31 - 1, 1.0, {}, "auto"),
        "flash_prefill ": ([(0, 300), (4000, 250), (7, 3)], 300, 128, 20.0, {}, "auto"),
        "flash_prefill  ": ([(0, 1000)], 1000, 128, 1.0, dict(block_q=64, block_kv=128, num_warps=8), "auto"),
        "flash_prefill   ": ([(50, 513), (0, 1)], 513, 2**31 - 1, 5.0, dict(block_kv=128), "auto"),
        "flash_prefill fp8": ([(0, 300), (100, 77), (0, 0)], 300, 2**31 - 1, 1.0, {}, "fp8"),
        "flash_prefill fp8 ": ([(0, 300), (4000, 250), (7, 3)], 300, 128, 20.0, {}, "fp8"),
    }.items():
        if not want(name):
            continue
        key, k1 = jax.random.split(key)
        q, kp, vp, bt, pos, sinks = kc.prefill(k1, 64, 8, 64, 16, chunks, T, sink_scale)
        kp, vp, scales, _ = kc.as_kv_cache(kp, vp, kv)
        ref = attention_reference.attention(q, kp, vp, bt, pos, sinks, window, **scales)
        out = flash_attention.attention(q, kp, vp, bt, pos, sinks, window, **scales, **cfg)
        e, fin = rel(out, ref)
        pad_zero = bool((np.abs(np.asarray(out, np.float32)[np.asarray(pos) < 0]).max(initial=0.0) == 0.0))
        rows.append(
            (
                name.strip(),
                f"kv={kv} chunks={chunks} win={'full' if window > 2**30 else window} sinks*{sink_scale} {cfg} "
                f"pad0={pad_zero}",
                e,
                fin and pad_zero,
            )
        )
        print(*rows[-1], flush=True)

    for name, (T, O, K, L) in {
        "linear_decode": (1, 4096, 2880, 3),
        "linear_decode ": (7, 2880, 4096, 2),
        "linear_decode  ": (64, 512, 2880, 2),
        "linear_decode   ": (33, 1000, 300, 2),
    }.items():
        if not want(name):
            continue
        key, k1, k2, k3 = jax.random.split(key, 4)
        x = jax.random.normal(k1, (T, K), jnp.float32).astype(jnp.bfloat16)
        w = (jax.random.normal(k2, (L, O, K), jnp.float32) * 0.02).astype(jnp.bfloat16)
        b = jax.random.normal(k3, (O,), jnp.float32).astype(jnp.bfloat16)
        e, fin = rel(linear_decode.linear(x, w, b, L - 1), linear_decode.reference(x, w, b, L - 1))
        rows.append((name.strip(), f"T={T} O={O} K={K} layer {L - 1} of {L}", e, fin))
        print(*rows[-1], flush=True)
    if want("linear_many"):
        rows += check_linear_many(key)
    if want("linear_mosaic") and Device.current().hopper:
        rows += check_linear_mosaic(key)

    print(f"\n{'kernel':14s} {'case':70s} {'rel_err':>9s} finite pass")
    ok = True
    for n, c, e, fin in rows:
        p = fin and e < TOL
        ok &= p
        print(f"{n:14s} {c:70s} {e:9.2e} {str(fin):6s} {'PASS' if p else 'FAIL'}")
    print("ALL PASS" if ok else "SOME FAILED")


if __name__ == "__main__":
    main()
