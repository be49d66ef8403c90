"""GPU timings of the Pallas kernels against ceilings measured in the same run and the best XLA paths.

    python -m tools.bench_kernels [--quick] [--out FILE]

Ceilings: device copy bandwidth (XLA u32 `x + 1` over 2 GiB, and torch `copy_` when torch is there;
bytes read + written) and bf16 matmul rate (8192^3 through XLA, and torch).  Every row prints time,
achieved bandwidth or FLOP rate, the ratio to the ceiling, and the XLA path on the same problem.
Decode MoE runs over `L` stacked layers (different weights and routing per layer, more bytes than
L2) unrolled in one jit, so time per layer excludes host dispatch and L2 reuse. MoE configurations are a
kernel module's `experts` (`pallas_kernels._EXPERTS`: its slot dispatch, kernels and combine; one-row slots
dispatch nothing) with launch settings: each decode sweep starts from what `choice.choose` picks without the
Mosaic GPU kernels, each prefill sweep from what it picks on this GPU.
"""

import argparse
import functools
import itertools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

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
    moe_slots,
    paged_attention,
    ragged_dot,
)
from pallas_kernels.choice import Device, choose
from tools import common
from tools import kernel_cases as kc

LINES = []


def log(s=""):
    print(s, flush=True)
    LINES.append(s)


def timed(label, f, *args, **kw):
    """`timeit`, or None (logged) when the configuration fails to compile or run: sweeps go on."""
    try:
        return timeit(f, *args, **kw)
    except Exception as e:  # noqa: BLE001
        log(f"  {label}: FAILED {type(e).__name__}: {str(e)[:200]}")
        return None


def fastest(label, cfgs, make_run, args, per, line):
    """Times `make_run(cfg)(*args)` / `per` for each configuration, logging `line(t, cfg)`; -> the fastest
    `(t, cfg)`, or None when none ran."""
    best = None
    for cfg in cfgs:
        t = timed(f"{label} {cfg}", make_run(cfg), *args)
        if t is None:
            continue
        t /= per
        log(line(t, cfg))
        if best is None or t < best[0]:
            best = (t, cfg)
    return best


def timeit(f, *args, n=10, reps=5):
    """Seconds per call of `f(*args)`: `n` calls back to back per round, median of `reps` rounds."""
    return common.timeit(lambda: f(*args), warmup=1, reps=reps, calls=n)


def ceilings():
    bw_xla = common.copy_bandwidth(2 << 30, warmup=1, reps=5, calls=10)
    mm_xla = common.matmul_rate(8192, warmup=1, reps=5, calls=10)
    bw_torch = mm_torch = 0.0
    try:
        bw_torch, mm_torch = common.torch_copy_bandwidth(2 << 30), common.torch_matmul_rate(8192)
    except Exception as e:  # noqa: BLE001
        log(f"(torch ceilings unavailable: {e!r})")
    log(
        f"copy bandwidth: XLA {bw_xla / 1e12:.2f} TB/s, torch copy_ {bw_torch / 1e12:.2f} TB/s; "
        f"bf16 matmul 8192^3: XLA {mm_xla / 1e12:.0f} TFLOP/s, torch {mm_torch / 1e12:.0f} TFLOP/s"
    )
    return max(bw_xla, bw_torch), max(mm_xla, mm_torch)


def chosen(kernels: KernelConfig, model: str, T: int) -> dict:
    """The experts configuration `kernels` (resolved) picks for `T` tokens of `model`'s shape, as a dict with its
    `kernel`."""
    s = kc.SHAPES[model]
    c = choose("experts", T, (s["D"], s["I"], s["E"], s["k"]), jnp.bfloat16, kernels.device, kernels)
    return {"kernel": c.kernel, **c.launch}


def run_experts(cfg: dict, x, idx, w, kexp):
    """The MoE kernel module `cfg["kernel"]` names (`pallas_kernels._EXPERTS`), the rest of `cfg` its launch."""
    launch = dict(cfg)
    return pallas_kernels._EXPERTS[launch.pop("kernel")](
        x, idx, w, kexp, swiglu_limit=kc.LIMIT, swiglu_alpha=kc.ALPHA, **launch
    )


def expert_bytes(D, I):
    return (2 * I * D // 2 + 2 * I * D // 32 + 2 * I * 2) + (D * I // 2 + D * I // 32 + D * 2)


def bench_moe_decode(model, Ts, bw, configs, L, engine: KernelConfig):
    """Each configuration of `configs(T)` against the kernel `engine` picks and XLA's gather path."""
    s = kc.SHAPES[model]
    E, D, I, k = s["E"], s["D"], s["I"], s["k"]
    # Separate arrays per layer: slicing a stacked [L, ...] array inside jit would copy the layer.
    ex = [kc.experts(jax.random.PRNGKey(20 + i), E, D, I) for i in range(L)]
    kx = [jax.jit(expert_format.prepare_experts)(e) for e in ex]
    for T in Ts:
        xs, idxs, ws, uniq = [], [], [], 0
        for li in range(L):
            x, rw, rb = kc.router(jax.random.PRNGKey(100 * T + li), E, D, T)
            idx, w, _ = moe_reference.route(x, rw, rb, k)
            xs.append(x), idxs.append(idx), ws.append(w)
            uniq += len(np.unique(np.asarray(idx)))
        nbytes = uniq * expert_bytes(D, I) / L
        best = fastest(
            f"moe_decode {model} T={T}",
            configs(T),
            lambda cfg: jax.jit(
                lambda xs, kx, cfg=cfg: [run_experts(cfg, xs[i], idxs[i], ws[i], kx[i]) for i in range(L)]
            ),
            (xs, kx),
            L,
            lambda t, cfg: (
                f"  moe_decode {model} T={T:3d} experts {t * 1e6:8.1f} us  {nbytes / t / 1e12:5.2f} "
                f"TB/s = {nbytes / t / bw * 100:5.1f}% of copy  cfg={cfg}"
            ),
        )
        if best is None:
            continue

        def as_chosen(xs, kx):
            return [
                pallas_kernels.experts(
                    xs[i], idxs[i], ws[i], kx[i], None, swiglu_limit=kc.LIMIT, swiglu_alpha=kc.ALPHA, kernels=engine
                )
                for i in range(L)
            ]

        t_chosen = timeit(jax.jit(as_chosen), xs, kx) / L
        t_ref = (
            timeit(jax.jit(lambda xs, ex: [_ref_experts(xs[i], idxs[i], ws[i], ex[i]) for i in range(L)]), xs, ex) / L
        )
        log(
            f"ROW moe_decode {model:4s} T={T:3d} | "
            f"pallas best {best[0] * 1e6:8.1f} us {nbytes / best[0] / 1e12:5.2f} TB/s "
            f"({nbytes / best[0] / bw * 100:4.1f}% of {bw / 1e12:.2f}) | "
            f"as chosen ({chosen(engine, model, T)['kernel']}) "
            f"{t_chosen * 1e6:8.1f} us | XLA gather+dequant+einsum {t_ref * 1e6:8.1f} us | bytes {nbytes / 1e6:.1f} MB"
        )
    del ex, kx


def _ref_experts(x, idx, w, ex):
    """moe_reference's gather path with given routing (XLA: gather packed experts, dequantize, einsum)."""
    from pallas_kernels import mxfp4

    dtype = x.dtype
    f32 = jnp.float32
    gu = mxfp4.dequantize(ex.gate_up_blocks[idx], ex.gate_up_scales[idx], dtype)
    z = jnp.einsum("td,tkod->tko", x, gu, preferred_element_type=f32) + ex.gate_up_bias[idx].astype(f32)
    a = moe_reference.swiglu(z, kc.LIMIT, kc.ALPHA).astype(dtype)
    dn = mxfp4.dequantize(ex.down_blocks[idx], ex.down_scales[idx], dtype)
    y = jnp.einsum("tki,tkdi->tkd", a, dn, preferred_element_type=f32) + ex.down_bias[idx].astype(f32)
    return jnp.einsum("tkd,tk->td", y, w).astype(dtype)


def bench_ragged_decode(model, T, bw):
    """lax.ragged_dot over pre-dequantized bf16 experts (one layer; it streams all experts)."""
    s = kc.SHAPES[model]
    E, D, I, k = s["E"], s["D"], s["I"], s["k"]
    wgu = jax.random.normal(jax.random.PRNGKey(3), (E, D, 2 * I), jnp.float32).astype(jnp.bfloat16)
    wdn = jax.random.normal(jax.random.PRNGKey(4), (E, I, D), jnp.float32).astype(jnp.bfloat16)
    x, rw, rb = kc.router(jax.random.PRNGKey(5), E, D, T)
    idx, w, _ = moe_reference.route(x, rw, rb, k)

    @jax.jit
    def f(x, idx, wgu, wdn):
        e = idx.reshape(-1)
        order = jnp.argsort(e)
        xs = x[order // k]
        gs = jnp.zeros((E,), jnp.int32).at[e].add(1)
        z = jax.lax.ragged_dot(xs, wgu, gs, preferred_element_type=jnp.float32)
        a = moe_reference.swiglu(z, kc.LIMIT, kc.ALPHA).astype(x.dtype)
        return jax.lax.ragged_dot(a, wdn, gs, preferred_element_type=jnp.float32)

    t = timeit(f, x, idx, wgu, wdn, n=5, reps=3)
    log(f"ROW ragged_dot(bf16) {model} T={T}: {t * 1e6:.1f} us (reads all {E} experts in bf16)")
    del wgu, wdn
    return t


def bench_ragged_stack(mm, bw, Ts, blocks=(128,)):
    """The prefill MoE's two grouped GEMMs on 20b shapes: jax's Mosaic ragged dot on one layer's experts against
    `pallas_kernels.ragged_dot` reading layer 1 of a 3-layer stack in place, and `moe_dense.dequantize_experts` (what
    a call without the stored copy pays first), with ours at each row block of `blocks`."""
    s = kc.SHAPES["20b"]
    E, D, I, k = s["E"], s["D"], s["I"], s["k"]
    kx = jax.jit(expert_format.prepare_experts)(kc.experts(jax.random.PRNGKey(6), E, D, I))
    deq = jax.jit(lambda kx: moe_dense.dequantize_experts(kx.gu_words, kx.gu_scales, kx.dn_words, kx.dn_scales))
    t_deq = timeit(deq, kx, n=5, reps=3)
    out_bytes = 3 * E * D * I * 2
    log(
        f"ROW dequantize_experts 20b layer: {t_deq * 1e3:.3f} ms "
        f"({out_bytes / t_deq / bw * 100:.0f}% of copy, bf16 out)"
    )
    for name, N, K in (("gate_up", 2 * I, D), ("down", D, I)):
        w = jax.random.normal(jax.random.PRNGKey(8), (3 * E, N, K), jnp.float32).astype(jnp.bfloat16)
        bn = next(b for b in (192, 128, 64) if N % b == 0)
        band = next(b for b in (5, 3, 2, 1) if (N // bn) % b == 0)
        for T in Ts:
            P = T * k
            sizes_np = np.bincount(np.random.default_rng(T).integers(0, E, P), minlength=E)
            flops = 2 * P * N * K
            launch = dict(block_m=128, block_n=bn, block_k=64, max_concurrent_steps=4, grid_block_n=band)
            jaxs = jax.jit(
                lambda x, w, g: ragged_dot_mgpu.ragged_dot(x, w, group_sizes=g, transpose_rhs=True, **launch)
            )
            x = jax.random.normal(jax.random.PRNGKey(9), (P, K), jnp.float32).astype(jnp.bfloat16)
            t_j = timeit(jaxs, x, jnp.asarray(w[E : 2 * E]), jnp.asarray(sizes_np, jnp.int32), n=5, reps=3)
            row = [f"jax's on the layer (128 rows) {t_j * 1e3:.3f} ms ({flops / t_j / mm * 100:.0f}% of matmul)"]
            starts = np.cumsum(sizes_np) - sizes_np
            for bm in blocks:
                ours = jax.jit(
                    lambda x, w, g, bm=bm: ragged_dot.ragged_dot(
                        x, w, jnp.int32(E), g, block_m=bm, block_n=bn, band=band
                    )
                )
                t_o = timeit(ours, x, w, jnp.asarray(sizes_np, jnp.int32), n=5, reps=3)
                tiles = sum(-(-(s % 8 + n) // bm) for s, n in zip(starts, sizes_np) if n)
                row.append(
                    f"ours {bm} rows {t_o * 1e3:.3f} ms ({flops / t_o / mm * 100:.0f}% of matmul, {tiles} tiles)"
                )
            log(f"ROW ragged_stack 20b {name} pairs={P}: " + ", ".join(row))
        del w


def bench_dispatch_order(cases=((32, 32), (128, 32), (512, 128), (4096, 32), (4096, 128), (16384, 32), (32768, 128))):
    """The MoE dispatch's stable order of P (token, expert) pairs by expert id (E + 1 ids: routed nowhere last):
    XLA's sort against `moe_slots.stable_order`'s counting (which the dispatch takes on the GPU past 1,024). Ten
    orders of rolled ids in one jit, so a call's launch is not what is timed."""
    for P, E in cases:
        e = jax.random.randint(jax.random.PRNGKey(P), (P,), 0, E + 1, jnp.int32)
        want = jnp.argsort(e, stable=True)
        row = []
        for name, order in (
            ("sort", lambda x: jnp.argsort(x, stable=True).astype(jnp.int32)),
            ("counting", lambda x, E=E: moe_slots.stable_order(x, E + 1, counting=True)),
        ):
            assert (jax.jit(order)(e) == want).all(), name
            ten = jax.jit(lambda x, order=order: jnp.stack([order(jnp.roll(x, i)) for i in range(10)]))
            row.append(f"{name} {timeit(ten, e, n=20) / 10 * 1e6:.1f} us")
        log(f"ROW dispatch_order pairs={P} ids={E + 1}: " + ", ".join(row))


def bench_moe_prefill(model, T, mm, configs, bw, ragged=True):
    """Grouped-GEMM regime: FLOP rate against the matmul ceiling, and the routed experts' bytes against the
    copy bandwidth (what bounds a few hundred tokens); `ragged` adds the `ragged_dot` and XLA rows."""
    s = kc.SHAPES[model]
    E, D, I, k = s["E"], s["D"], s["I"], s["k"]
    ex = kc.experts(jax.random.PRNGKey(6), E, D, I)
    kx = jax.jit(expert_format.prepare_experts)(ex)
    x, rw, rb = kc.router(jax.random.PRNGKey(7), E, D, T)
    idx, w, _ = moe_reference.route(x, rw, rb, k)
    flops = 2 * T * k * (D * 2 * I + I * D)
    nbytes = len(np.unique(np.asarray(idx))) * expert_bytes(D, I)

    def rate(t):
        return (
            f"{flops / t / 1e12:6.1f} TFLOP/s = {flops / t / mm * 100:5.1f}% of matmul, "
            f"{nbytes / t / 1e12:5.2f} TB/s = {nbytes / t / bw * 100:5.1f}% of copy"
        )

    best = None
    for cfg in configs:
        f = jax.jit(lambda x, idx, w, kx, cfg=cfg: run_experts(cfg, x, idx, w, kx))
        t = timed(f"moe_prefill {model} T={T} {cfg}", f, x, idx, w, kx, n=5, reps=3)
        if t is None:
            continue
        log(f"  moe_prefill {model} T={T} {t * 1e3:8.3f} ms {rate(t)} cfg={cfg}")
        if best is None or t < best[0]:
            best = (t, cfg)
    if not best:
        return
    if not ragged:
        log(f"ROW moe_grouped {model:4s} T={T} | pallas {best[0] * 1e3:7.3f} ms {rate(best[0])} | cfg={best[1]}")
        return
    wgu = jax.random.normal(jax.random.PRNGKey(3), (E, D, 2 * I), jnp.float32).astype(jnp.bfloat16)
    wdn = jax.random.normal(jax.random.PRNGKey(4), (E, I, D), jnp.float32).astype(jnp.bfloat16)

    @jax.jit
    def rd(x, idx, wgu, wdn):
        e = idx.reshape(-1)
        order = jnp.argsort(e)
        xs = x[order // k]
        gs = jnp.zeros((E,), jnp.int32).at[e].add(1)
        z = jax.lax.ragged_dot(xs, wgu, gs, preferred_element_type=jnp.float32)
        a = moe_reference.swiglu(z, kc.LIMIT, kc.ALPHA).astype(x.dtype)
        return jax.lax.ragged_dot(a, wdn, gs, preferred_element_type=jnp.float32)

    try:
        t_rd = timeit(rd, x, idx, wgu, wdn, n=1, reps=2)
    except Exception as e:  # noqa: BLE001
        t_rd = float("nan")
        log(f"  ragged_dot failed: {e!r}"[:300])
    del wgu, wdn
    t_ref = timeit(
        jax.jit(
            lambda x, rw, rb, ex: moe_reference.moe(
                x, rw, rb, ex, top_k=k, swiglu_limit=kc.LIMIT, swiglu_alpha=kc.ALPHA
            )
        ),
        x,
        rw,
        rb,
        ex,
        n=1,
        reps=2,
    )
    log(
        f"ROW moe_prefill {model:4s} T={T} | pallas {best[0] * 1e3:7.2f} ms {flops / best[0] / 1e12:6.1f} TFLOP/s "
        f"({flops / best[0] / mm * 100:4.1f}% of {mm / 1e12:.0f}) | ragged_dot bf16 {t_rd * 1e3:8.2f} ms "
        f"(pallas {t_rd / best[0]:5.1f}x faster) | XLA dequant+einsum scan {t_ref * 1e3:8.2f} ms | cfg={best[1]}"
    )


def bench_swiglu_epilogue(model, T, bw, configs):
    """The grouped path's gate/up epilogue (`moe_dense.swiglu_epilogue`) on `T * k` rows sorted by expert, against
    the XLA fusion it replaced and the copy bandwidth (bytes read + written)."""
    s = kc.SHAPES[model]
    E, I, P = s["E"], s["I"], T * s["k"]
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(P), 3)
    z = (jax.random.normal(k1, (P, 2 * I), jnp.float32) * 2.0**-13).astype(jnp.bfloat16)
    e = jnp.sort(jax.random.randint(k2, (P,), 0, E, jnp.int32))
    bias = jax.random.normal(k3, (E, 2, I), jnp.float32).astype(jnp.bfloat16)
    nbytes = 3 * P * I * 2

    xla = jax.jit(functools.partial(moe_dense.swiglu_epilogue_reference, limit=kc.LIMIT, alpha=kc.ALPHA))
    t_xla = timeit(xla, z, e, bias)
    best = fastest(
        f"swiglu_epilogue {model} T={T}",
        configs,
        lambda cfg: jax.jit(lambda z, e, b: moe_dense.swiglu_epilogue(z, e, b, limit=kc.LIMIT, alpha=kc.ALPHA, **cfg)),
        (z, e, bias),
        1,
        lambda t, cfg: f"  swiglu_epilogue {model} P={P} {t * 1e3:7.3f} ms {nbytes / t / 1e12:5.2f} TB/s cfg={cfg}",
    )
    if best:
        log(
            f"ROW swiglu_epilogue {model:4s} T={T} P={P} | pallas {best[0] * 1e3:7.3f} ms "
            f"{nbytes / best[0] / 1e12:5.2f} TB/s ({nbytes / best[0] / bw * 100:4.1f}% of copy) | XLA "
            f"{t_xla * 1e3:7.3f} ms {nbytes / t_xla / 1e12:5.2f} TB/s | cfg={best[1]}"
        )


def bench_linear(bw, Ts, configs, L=8):
    """Decode projections over L stacked layers (more bytes than L2): the kernel reading each layer in
    place vs XLA on the stacked weight (layer slice copied, then GEMM) and on separate arrays (no copy)."""
    for name, O, K in (("q_proj", 4096, 2880), ("o_proj", 2880, 4096), ("k_proj", 512, 2880)):
        w = (jax.random.normal(jax.random.PRNGKey(O + K), (L, O, K), jnp.float32) * 0.02).astype(jnp.bfloat16)
        sep = [w[i] + 0 for i in range(L)]
        b = jnp.zeros((O,), jnp.bfloat16)
        layers = jnp.arange(L, dtype=jnp.int32)  # traced, as in the layer scan
        nbytes = O * K * 2
        for T in Ts:
            x = jax.random.normal(jax.random.PRNGKey(T), (T, K), jnp.float32).astype(jnp.bfloat16)
            best = fastest(
                f"linear {name} T={T}",
                configs,
                lambda cfg: jax.jit(lambda x, w, ls: [linear_decode.linear(x, w, b, ls[i], **cfg) for i in range(L)]),
                (x, w, layers),
                L,
                lambda t, cfg: f"  linear {name} T={T:3d} {t * 1e6:7.1f} us {nbytes / t / 1e12:5.2f} TB/s cfg={cfg}",
            )
            t_stk = (
                timeit(
                    jax.jit(lambda x, w, ls: [linear_decode.reference(x, w, b, ls[i]) for i in range(L)]), x, w, layers
                )
                / L
            )
            t_sep = (
                timeit(
                    jax.jit(
                        lambda x, ws: [jnp.einsum("ti,oi->to", x, wi, preferred_element_type=jnp.float32) for wi in ws]
                    ),
                    x,
                    sep,
                )
                / L
            )
            log(
                f"ROW linear_decode {name} [{O}x{K}] T={T:3d} | pallas {best[0] * 1e6:6.1f} us "
                f"{nbytes / best[0] / 1e12:5.2f} TB/s ({nbytes / best[0] / bw * 100:4.1f}% of {bw / 1e12:.2f}) | "
                f"XLA stacked "
                f"(slice copy + GEMM) {t_stk * 1e6:6.1f} us | XLA separate arrays {t_sep * 1e6:6.1f} us "
                f"({nbytes / t_sep / bw * 100:4.1f}%) | best {best[1]}"
            )
        del w, sep


def bench_linear_many(bw, configs, T=1, L=8):
    """Batch-1 q, k, v projections (gpt-oss [4096, 512, 512] x 2880, 20b and 120b alike) over L stacked
    layers: one fused launch (`linear_many`) vs three `linear` launches, same configuration, same bytes."""
    Os, K = (4096, 512, 512), 2880
    ws = tuple(
        (jax.random.normal(jax.random.PRNGKey(O + i), (L, O, K), jnp.float32) * 0.02).astype(jnp.bfloat16)
        for i, O in enumerate(Os)
    )
    bs = tuple(jnp.zeros((O,), jnp.bfloat16) for O in Os)
    x = jax.random.normal(jax.random.PRNGKey(T), (T, K), jnp.float32).astype(jnp.bfloat16)
    layers = jnp.arange(L, dtype=jnp.int32)  # traced, as in the layer scan
    nbytes = sum(Os) * K * 2
    makers = {
        "fused": lambda cfg: jax.jit(
            lambda x, ws, ls: [linear_decode.linear_many(x, ws, bs, ls[i], **cfg) for i in range(L)]
        ),
        "3 launches": lambda cfg: jax.jit(
            lambda x, ws, ls: [linear_decode.linear(x, w, b, ls[i], **cfg) for i in range(L) for w, b in zip(ws, bs)]
        ),
    }
    best = {
        name: fastest(
            f"linear qkv {name} T={T}",
            configs,
            make,
            (x, ws, layers),
            L,
            lambda t, cfg, name=name: (
                f"  linear qkv {name:10s} T={T:3d} {t * 1e6:7.1f} us {nbytes / t / 1e12:5.2f} TB/s cfg={cfg}"
            ),
        )
        for name, make in makers.items()
    }
    best = {k: v for k, v in best.items() if v}
    if len(best) == 2:
        (tf, cf), (ts, cs) = best["fused"], best["3 launches"]
        log(
            f"ROW linear_decode qkv fused [({'+'.join(map(str, Os))}) x {K}] T={T:3d} | "
            f"pallas fused {tf * 1e6:6.1f} us "
            f"{nbytes / tf / 1e12:5.2f} TB/s ({nbytes / tf / bw * 100:4.1f}% of {bw / 1e12:.2f}) cfg={cf} | 3 launches "
            f"{ts * 1e6:6.1f} us {nbytes / ts / 1e12:5.2f} TB/s cfg={cs}"
        )
    del ws


def bench_linear_mosaic(bw, mm, Ts, splits_opts, L=8):
    """The attention projections of one layer (q/k/v fused, then o) over L stacked layers, the layer index traced
    as in the scan: the Mosaic kernel (configurations swept; `linear_mosaic.config`'s marked) vs the Triton kernel
    (up to its 64 rows) and XLA (layer slice copied, then GEMM; and on separate arrays: no copy)."""
    for name, Os, K in (("o", (2880,), 4096), ("qkv", (4096, 512, 512), 2880)):
        ws = tuple(
            (jax.random.normal(jax.random.PRNGKey(O + i), (L, O, K), jnp.float32) * 0.02).astype(jnp.bfloat16)
            for i, O in enumerate(Os)
        )
        bs = tuple(jnp.zeros((O,), jnp.bfloat16) for O in Os)
        seps = [[w[i] + 0 for i in range(L)] for w in ws]
        layers = jnp.arange(L, dtype=jnp.int32)
        nbytes = sum(Os) * K * 2
        for T in Ts:
            x = jax.random.normal(jax.random.PRNGKey(T), (T, K), jnp.float32).astype(jnp.bfloat16)
            flops = 2 * T * sum(Os) * K
            base = linear_mosaic.config(T, K, Os, Device.current().num_sms)
            cfgs = [base] + [dict(base, splits=s) for s in splits_opts if s != base["splits"] and (K // 64) % s == 0]
            best = fastest(
                f"linear_mosaic {name} T={T}",
                cfgs,
                lambda cfg: jax.jit(
                    lambda x, ws, ls: [linear_mosaic.linear_many(x, ws, bs, ls[i], **cfg) for i in range(L)]
                ),
                (x, ws, layers),
                L,
                lambda t, cfg: (
                    f"  linear_mosaic {name} T={T:3d} {t * 1e6:7.1f} us {nbytes / t / 1e12:5.2f} TB/s "
                    f"{flops / t / 1e12:6.1f} TFLOP/s cfg={cfg}{' (config)' if cfg is base else ''}"
                ),
            )
            t_tri = None
            if T <= linear_decode.MAX_ROWS:
                t_tri = (
                    timeit(
                        jax.jit(
                            lambda x, ws, ls: [
                                linear_decode.linear_many(x, ws, bs, ls[i])
                                if T <= KernelConfig().linear_fuse_rows
                                else [linear_decode.linear(x, w, b, ls[i]) for w, b in zip(ws, bs)]
                                for i in range(L)
                            ]
                        ),
                        x,
                        ws,
                        layers,
                    )
                    / L
                )
            t_stk = (
                timeit(
                    jax.jit(
                        lambda x, ws, ls: [
                            [linear_decode.reference(x, w, b, ls[i]) for w, b in zip(ws, bs)] for i in range(L)
                        ]
                    ),
                    x,
                    ws,
                    layers,
                )
                / L
            )
            t_sep = (
                timeit(
                    jax.jit(
                        lambda x, seps: [
                            [jnp.einsum("ti,oi->to", x, s[i], preferred_element_type=jnp.float32) for s in seps]
                            for i in range(L)
                        ]
                    ),
                    x,
                    seps,
                )
                / L
            )
            tri = f"{t_tri * 1e6:6.1f} us" if t_tri else "-"
            if best:
                log(
                    f"ROW linear_mosaic {name} [{'+'.join(map(str, Os))} x {K}] T={T:3d} | mosaic "
                    f"{best[0] * 1e6:6.1f} us {nbytes / best[0] / 1e12:5.2f} TB/s "
                    f"({nbytes / best[0] / bw * 100:4.1f}% of copy {bw / 1e12:.2f}; "
                    f"{flops / best[0] / mm * 100:4.1f}% of matmul) cfg={best[1]} | triton {tri} | XLA stacked "
                    f"{t_stk * 1e6:6.1f} us | XLA separate {t_sep * 1e6:6.1f} us"
                )
        del ws, seps


def _reference(window: int):
    """The jitted paged reference attention: `(q, k, v, tables, positions, sinks, scales)`."""
    return jax.jit(lambda *a: attention_reference.attention(*a[:6], window, **a[6]))


def decode_launches(kernels: KernelConfig, kv_dtype: str) -> list[tuple]:
    """The decode attention launch `kernels` (resolved) picks over a cache of `kv_dtype`, then 64/3/4 and 128/3/4:
    (block_kv, num_stages, num_warps) each."""
    return list(dict.fromkeys([tuple(kc.decode_launch(kernels, kv_dtype).values()), (64, 3, 4), (128, 3, 4)]))


def bench_paged(bw, cases, split_opts, kv_dtypes=("auto",), launches=None, engine=None):
    """Decode attention; `launches`: the (block_kv, num_stages, num_warps) settings swept with each split count
    (None: `decode_launches` of the `engine` config for each cache dtype)."""
    for (B, ctx, window, S), kv_dtype in itertools.product(cases, kv_dtypes):
        q, kp, vp, bt, pos, sinks = kc.paged(jax.random.PRNGKey(B + ctx), B, 64, 8, 64, S, [ctx] * B)
        kp, vp, scales, value_bytes = kc.as_kv_cache(kp, vp, kv_dtype)
        vis = min(ctx, window)
        nbytes = B * vis * 8 * 64 * 2 * value_bytes
        best = None
        for ns, (bkv, stages, warps) in itertools.product(split_opts(B), launches or decode_launches(engine, kv_dtype)):
            kw = dict(num_splits=ns, block_kv=bkv, num_stages=stages, num_warps=warps)
            f = jax.jit(
                lambda q, kp, vp, bt, pos, sinks, scales, kw=kw: paged_attention.attention(
                    q, kp, vp, bt, pos, sinks, window, **scales, **kw
                )
            )
            launch = f"splits={ns} bkv={bkv} stages={stages} warps={warps}"
            t = timed(f"paged B={B} ctx={ctx} {launch}", f, q, kp, vp, bt, pos, sinks, scales, n=20)
            if t is None:
                continue
            log(
                f"  paged kv={kv_dtype} B={B} ctx={ctx} win={window} page={S} {launch}: {t * 1e6:8.1f} us "
                f"{nbytes / t / 1e12:5.2f} TB/s = {nbytes / t / bw * 100:5.1f}%"
            )
            if best is None or t < best[0]:
                best = (t, ns, launch)
        t_ref = timeit(_reference(window), q, kp, vp, bt, pos, sinks, scales, n=5)
        # jax.nn.dot_product_attention on a contiguous [B, ctx, K, H] cache (no sinks, no paging).
        kc_ = jax.random.normal(jax.random.PRNGKey(9), (B, ctx, 8, 64), jnp.float32).astype(jnp.bfloat16)
        res = {}
        for impl in ("cudnn", "xla"):
            try:
                g = jax.jit(
                    lambda q, k, v, impl=impl: jax.nn.dot_product_attention(
                        q, k, v, implementation=impl, local_window_size=(window - 1, 0) if window < ctx else None
                    )
                )
                res[impl] = timeit(g, q, kc_, kc_, n=10)
            except Exception:  # noqa: BLE001
                res[impl] = float("nan")
        del kp, vp, kc_
        log(
            f"ROW paged_decode kv={kv_dtype} B={B} ctx={ctx} win={window} page={S} | pallas {best[0] * 1e6:8.1f} us "
            f"{nbytes / best[0] / 1e12:5.2f} TB/s ({nbytes / best[0] / bw * 100:4.1f}% of {bw / 1e12:.2f}) "
            f"{best[2]} | XLA paged reference {t_ref * 1e6:8.1f} us | jax.nn.dpa contiguous cudnn "
            f"{res['cudnn'] * 1e6:8.1f} us xla {res['xla'] * 1e6:8.1f} us | KV bytes {nbytes / 1e6:.0f} MB"
        )


def bench_flash(mm, cases, cfgs, kv_dtypes=("auto",)):
    """Prefill attention: Pallas kernel vs the paged reference and jax.nn.dot_product_attention (cudnn,
    contiguous K/V, causal + window, no sinks and no paging: a lower bound for what a library gives)."""
    N, K, H, S = 64, 8, 64, 16
    for (B, T, start, window), kv_dtype in itertools.product(cases, kv_dtypes):
        q, kp, vp, bt, pos, sinks = kc.prefill(jax.random.PRNGKey(T + B), N, K, H, S, [(start, T)] * B, T)
        kp, vp, scales, _ = kc.as_kv_cache(kp, vp, kv_dtype)
        vis = [min(start + t + 1, window) for t in range(T)]
        flops = 4 * B * N * H * sum(vis)
        best = None
        for cfg in cfgs:
            f = jax.jit(lambda *a, cfg=cfg: flash_attention.attention(*a[:6], window, **a[6], **cfg))
            t = timed(f"flash B={B} T={T} {cfg}", f, q, kp, vp, bt, pos, sinks, scales, n=5, reps=3)
            if t is None:
                continue
            log(
                f"  flash kv={kv_dtype} B={B} T={T} start={start} win={window} {t * 1e3:7.3f} ms "
                f"{flops / t / 1e12:6.1f} TFLOP/s "
                f"cfg={cfg}"
            )
            if best is None or t < best[0]:
                best = (t, cfg)
        try:
            t_ref = timeit(_reference(window), q, kp, vp, bt, pos, sinks, scales, n=2, reps=2)
        except Exception as e:  # noqa: BLE001
            t_ref = float("nan")
            log(f"  reference failed: {type(e).__name__}: {str(e)[:150]}")
        kc_ = jax.random.normal(jax.random.PRNGKey(9), (B, start + T, K, H), jnp.float32).astype(jnp.bfloat16)
        try:
            g = jax.jit(
                lambda q, k, v: jax.nn.dot_product_attention(
                    q,
                    k,
                    v,
                    implementation="cudnn",
                    is_causal=start == 0,
                    local_window_size=(window - 1, 0) if window < start + T else None,
                )
            )
            t_dpa = timeit(g, q, kc_, kc_, n=5, reps=3)
        except Exception as e:  # noqa: BLE001
            t_dpa = float("nan")
            log(f"  dpa cudnn failed: {type(e).__name__}: {str(e)[:150]}")
        del kp, vp, kc_
        log(
            f"ROW flash_prefill kv={kv_dtype} B={B} T={T} start={start} "
            f"win={'full' if window > 2**30 else window} | pallas "
            f"{best[0] * 1e3:7.3f} ms {flops / best[0] / 1e12:6.1f} TFLOP/s ({flops / best[0] / mm * 100:4.1f}% of "
            f"{mm / 1e12:.0f}) {best[1]} | paged reference {t_ref * 1e3:8.3f} ms | dpa cudnn contiguous "
            f"(no sinks) {t_dpa * 1e3:7.3f} ms"
        )


def main():
    runtime.prepare()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="")
    ap.add_argument("--models", default="20b,120b", help="MoE shapes to run")
    ap.add_argument("--tokens", default="", help="MoE decode token counts (default: 1,4,16,64)")
    ap.add_argument("--prefill-tokens", default="8192", help="MoE prefill / large-batch token counts")
    ap.add_argument("--kv-cache-dtypes", default="auto", help="attention cases' KV caches: auto,fp8")
    ap.add_argument(
        "--sweep", action="store_true", help="attention: a wider grid of launch settings, on the long-context cases"
    )
    ap.add_argument(
        "--decode-launches",
        default="",
        help="with --sweep: the decode grid as BKV:STAGES:WARPS[,...] (default: 64,128,256 x 2,3,4,5,7 x 2,4,8)",
    )
    ap.add_argument(
        "--flash-launches",
        default="",
        help="prefill attention launches BQ:BKV:WARPS:STAGES[,...] on the long-context cases (replaces --sweep's)",
    )
    ap.add_argument(
        "--moe-launches",
        default="",
        help="moe_decode, 2+ tokens: gemv16 launches BN:BK:WARPS:STAGES[:p][,...] (p: register double buffer)",
    )
    ap.add_argument(
        "--ragged-blocks",
        default="128",
        help="ragged_stack: our kernel's row blocks (block_m), e.g. 128,64",
    )
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    kv_dtypes = tuple(args.kv_cache_dtypes.split(","))
    log(f"device: {jax.devices()[0].device_kind}  date {time.strftime('%Y-%m-%d %H:%M')}")
    bw, mm = ceilings()
    only = (
        set(args.only.split(","))
        if args.only
        else {
            "linear",
            "linear_mosaic",
            "moe_decode",
            "paged",
            "flash",
            "moe_prefill",
            "moe_epilogue",
            "ragged",
            "dispatch_order",
        }
    )

    auto, triton = (KernelConfig(impl="pallas", mosaic=m).for_device() for m in (None, False))

    def dec_cfgs(model, T):
        k, E = kc.SHAPES[model]["k"], kc.SHAPES[model]["E"]
        out = [chosen(triton, model, T)]
        if args.quick:
            return out
        g16 = dict(
            kernel="gemv16",
            block_m=1,
            block_n=16,
            block_k=512,
            block_n_down=16,
            num_warps=4,
            num_stages=1,
            prefetch=T == 1,
        )
        if T == 1:  # latency-bound: fewer, larger K steps and smaller row tiles put more bytes in flight
            return out + [
                dict(g16, block_n=bn, block_n_down=bn, block_k=bk, prefetch=pf, num_warps=w)
                for bn, bk, pf, w in (
                    (8, 1024, True, 4),
                    (8, 2048, False, 4),
                    (8, 4096, False, 4),
                    (4, 4096, False, 4),
                    (8, 4096, False, 8),
                    (16, 2048, False, 4),
                )
            ]
        if T * k <= 2 * E and args.moe_launches:
            return out + [kc.gemv16_launch(v) for v in args.moe_launches.split(",")]
        if T * k <= 2 * E:  # also slots of 2-8 rows (pairs grouped by expert: one weight read, decoded once)
            return out + [
                g16,
                dict(g16, prefetch=T != 1),
                dict(g16, block_k=1024),
                dict(g16, block_n=32, block_n_down=32),
                *(dict(g16, block_m=bm, block_k=1024) for bm in (2, 4, 8) if bm <= T),
            ]
        return out + [
            dict(kernel="mma", block_m=bm, block_n=bn, block_k=bk, block_n_down=bn, num_warps=4, num_stages=3, swap=sw)
            for bm, bn, bk, sw in ((16, 64, 128, True), (32, 32, 256, False), (16, 32, 128, False))
        ]

    t0 = time.time()
    if "dispatch_order" in only:
        bench_dispatch_order()
    if "linear" in only:
        lcfgs = [
            dict(block_n=32, block_k=256, programs=528, num_warps=4, num_stages=3),
            dict(block_n=16, block_k=256, programs=1056, num_warps=4, num_stages=2),
            dict(block_n=32, block_k=128, programs=1056, num_warps=4, num_stages=2),
            dict(block_n=64, block_k=256, programs=528, num_warps=4, num_stages=2),
            dict(block_n=32, block_k=512, programs=264, num_warps=4, num_stages=2),
            dict(block_n=32, block_k=256, programs=1056, num_warps=4, num_stages=2),
        ]
        bench_linear(bw, (1, 16, 64), lcfgs[:1] if args.quick else lcfgs)
        bench_linear_many(bw, lcfgs[:1] if args.quick else lcfgs)
    if "linear_mosaic" in only and Device.current().hopper:
        bench_linear_mosaic(bw, mm, (1, 2, 8, 32, 64, 128, 256), () if args.quick else (1, 2, 3, 4, 5, 8, 9, 16))
    log(f"[{time.time() - t0:.0f}s]")
    if "moe_decode" in only:
        for model, Ts, L in (("20b", (1, 4, 16, 64), 3), ("120b", (1, 4, 16, 64), 2)):
            if args.tokens:
                Ts = tuple(int(t) for t in args.tokens.split(","))
            if model in args.models.split(","):
                bench_moe_decode(model, Ts, bw, lambda T, model=model: dec_cfgs(model, T), L, auto)
    log(f"[{time.time() - t0:.0f}s]")
    if "paged" in only:
        paged_cases = [(64, 8192, 2**31 - 1, 16), (64, 8192, 128, 16), (8, 32768, 2**31 - 1, 16)]
        if args.sweep:  # stages >= 5: two K/V buffers (the loads hang off the block table's: docs/kernels.md)
            launches = list(itertools.product((64, 128, 256), (2, 3, 4, 5, 7), (2, 4, 8)))
            if args.decode_launches:
                launches = [tuple(int(x) for x in c.split(":")) for c in args.decode_launches.split(",")]
            cases = [paged_cases[0], paged_cases[2]]
            bench_paged(bw, cases, lambda B: (1,) if B >= 32 else (8,), kv_dtypes, launches)
        else:
            bench_paged(bw, paged_cases, lambda B: (1, 2) if B >= 32 else (4, 16), kv_dtypes, engine=auto)
    log(f"[{time.time() - t0:.0f}s]")
    if "flash" in only:
        fcfgs = [
            dict(block_q=128, block_kv=64, num_warps=8, num_stages=3),
            dict(block_q=64, block_kv=64, num_warps=4, num_stages=3),
            dict(block_q=128, block_kv=128, num_warps=8, num_stages=3),
        ]
        causal_8k, sliding_8k, chunks_4x2k = (1, 8192, 0, 2**31 - 1), (1, 8192, 0, 128), (4, 2048, 2048, 2**31 - 1)
        flash_cases = [causal_8k, sliding_8k, chunks_4x2k]
        if args.sweep:
            grid = itertools.product((64, 128, 256), (64, 128), (4, 8), (3,))
            more = ((128, 32, 8, 3), (64, 32, 4, 3), (128, 64, 8, 2), (256, 64, 8, 2), (128, 64, 8, 5), (64, 64, 4, 5))
            more += ((128, 128, 8, 5), (64, 64, 4, 7), (128, 64, 8, 7))
            fcfgs = [
                dict(block_q=bq, block_kv=bkv, num_warps=w, num_stages=st)
                for bq, bkv, w, st in [*grid, *more]
                if not (bq == 256 and w == 4)
            ]
            flash_cases = [causal_8k, chunks_4x2k]
        if args.flash_launches:  # with the engine's long-prompt call too: 8 chunks of 2,048 after 6,144 cached
            launches = [[int(x) for x in c.split(":")] for c in args.flash_launches.split(",")]
            fcfgs = [dict(block_q=bq, block_kv=bkv, num_warps=w, num_stages=st) for bq, bkv, w, st in launches]
            flash_cases = [causal_8k, chunks_4x2k, (8, 2048, 6144, 2**31 - 1)]
        bench_flash(mm, flash_cases, fcfgs if not args.quick else fcfgs[:1], kv_dtypes)
    log(f"[{time.time() - t0:.0f}s]")
    if "ragged" in only:
        bench_ragged_decode("20b", 1, bw)
    if "ragged_stack" in only and Device.current().hopper:
        Ts = [int(t) for t in args.prefill_tokens.split(",")]
        bench_ragged_stack(mm, bw, Ts, tuple(int(b) for b in args.ragged_blocks.split(",")))
    if "moe_prefill" in only:

        def mma(bm, bn, bk, swap, warps, stages=3):
            return dict(
                kernel="mma",
                block_m=bm,
                block_n=bn,
                block_k=bk,
                block_n_down=bn,
                num_warps=warps,
                num_stages=stages,
                swap=swap,
            )

        def dense(bm, bn, bk, warps, stages=3):
            return dict(
                kernel="dense",
                block_m=bm,
                block_n=bn,
                block_k=bk,
                num_warps=warps,
                num_stages=stages,
                group=moe_dense.GROUP,
            )

        for T in (int(t) for t in args.prefill_tokens.split(",")):
            for model in args.models.split(","):
                # from 64 rows per expert, the Pallas-Triton choice is the dense GEMMs' configuration
                cfgs = [chosen(auto, model, T)] + (
                    [chosen(triton, model, T), dense(128, 128, 64, 8, 4), mma(128, 64, 128, True, 4)]
                    if T >= 4096
                    else [
                        mma(64, 32, 256, False, 4),
                        mma(32, 32, 256, False, 4),
                        mma(64, 64, 128, True, 4),
                        mma(128, 64, 128, True, 4),
                        dense(128, 128, 64, 8),
                    ]
                )
                bench_moe_prefill(model, T, mm, cfgs[:1] if args.quick else cfgs, bw, ragged=T >= 4096)
    log(f"[{time.time() - t0:.0f}s]")
    if "moe_epilogue" in only:
        ecfgs = [
            dict(block_m=bm, block_n=bn, num_warps=w)
            for bm, bn, w in ((32, 256, 4), (16, 512, 4), (64, 256, 8), (64, 64, 4), (128, 64, 4), (8, 1024, 4))
        ]
        for T in (int(t) for t in args.prefill_tokens.split(",")):
            for model in (m for m in args.models.split(",") if kc.SHAPES[m]["E"] <= moe_dense.GROUP):  # grouped
                bench_swiglu_epilogue(model, T, bw, ecfgs[:1] if args.quick else ecfgs)
    log(f"[{time.time() - t0:.0f}s]")
    log("\nSUMMARY")
    for line in LINES:
        if line.startswith(("ROW", "copy", "device")):
            print(line)
    if args.out:
        open(args.out, "w").write("\n".join(LINES) + "\n")


if __name__ == "__main__":
    sys.exit(main())
