"""Per-kernel GPU time of the decode MoE's `gemv16` kernels as the serving step runs them, across variants.

The step's batch-1 path is `moe_decode.run_routed` on layer-stacked experts, one layer after another, each layer's
experts new to the L2 cache. This runs exactly that for `--layers` layers of random weights (enough to exceed the
L2), traces it with `jax.profiler` and sums each kernel's GPU time per layer, so the figures are kernel times
without launch gaps, comparable with `tools/profile_decode.py`. Bytes count the distinct routed experts' packed
weights and scales; the ceiling is the copy bandwidth measured in the same run.

A variant is `name:key=value,...`: keys without a dot override `decode_config`'s settings (block_n, block_k,
block_n_down, num_warps, num_stages, prefetch; path=slots routes in XLA and runs `experts_forward`, whose kernels
read slot arrays); `module.ATTR=value` overrides a module constant:

    python tools/probe_moe_gemv.py --models 20b,120b --tokens 1,4 \\
        --variant bn8:block_n=8,block_n_down=8 --variant w8:num_warps=8
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_decode import copy_bandwidth  # noqa: E402
from profile_decode import summarize_trace  # noqa: E402
from kernel_cases import ALPHA, LIMIT, SHAPES  # noqa: E402
from pallas_kernels import moe_decode  # noqa: E402


def parse_variant(spec: str) -> tuple[str, dict, list]:
    """`name:key=value,...` -> (name, config overrides, [(module, attr, value)])."""
    name, _, sets = spec.partition(":")
    cfg, attrs = {}, []
    for item in filter(None, sets.split(",")):
        key, _, value = item.partition("=")
        if "." in key:
            mod, _, attr = key.rpartition(".")
            module = importlib.import_module(mod)
            if not hasattr(module, attr):
                raise SystemExit(f"--variant {spec!r}: {mod} has no attribute {attr!r}")
            attrs.append((module, attr, ast.literal_eval(value)))
        else:
            cfg[key] = ast.literal_eval(value)
    return name, cfg, attrs


def random_experts(L: int, E: int, D: int, I: int) -> moe_decode.KernelExperts:
    """Random words and E8M0 scales (2^-9 .. 2^-3) in the kernels' layout, one flat `[L * E]` expert axis."""
    ks = jax.random.split(jax.random.PRNGKey(0), 6)
    bits = lambda k, *s: jax.random.bits(k, s, jnp.uint32)
    sc = lambda k, *s: jax.random.randint(k, s, 118, 125, jnp.int32).astype(jnp.uint8)
    nrm = lambda k, *s: (jax.random.normal(k, s, jnp.float32) * 0.5).astype(jnp.bfloat16)
    n = L * E
    return moe_decode.KernelExperts(gu_words=bits(ks[0], n, 2, I, D // 8), gu_scales=sc(ks[1], n, 2, I, D // 32),
                                    gu_bias=nrm(ks[2], n, 2, I), dn_words=bits(ks[3], n, D, I // 8),
                                    dn_scales=sc(ks[4], n, D, I // 32), dn_bias=nrm(ks[5], n, D))



def expert_bytes(D: int, I: int) -> tuple[int, int]:
    """Packed weights + scales read per expert: (gate_up, down)."""
    return 2 * I * (D // 2 + D // 32), D * (I // 2 + I // 32)


def run_variant(model: str, T: int, L: int, kx, name: str, cfg_over: dict, attrs: list, reps: int,
                trace: bool = True) -> dict:
    s = SHAPES[model]
    E, D, I, k = s["E"], s["D"], s["I"], s["k"]
    keys = jax.random.split(jax.random.PRNGKey(T), 2)
    x = jax.random.normal(keys[0], (L, T, D), jnp.float32).astype(jnp.bfloat16)
    logits = jax.random.normal(keys[1], (L, T, E), jnp.float32)
    uniq = sum(len(np.unique(np.asarray(jax.lax.top_k(logits[i], k)[1]))) for i in range(L)) / L
    cfg = dict(moe_decode.decode_config(T, k, E, half=True), **cfg_over)
    path = cfg.pop("path", "routed")
    saved = [(m, a, getattr(m, a)) for m, a, _ in attrs]
    for m, a, v in attrs:
        setattr(m, a, v)
    jax.clear_caches()
    try:
        @jax.jit
        def step(x, logits, kx):
            out = []
            for i in range(L):  # one layer after another, as the decode step's scan runs them
                if path == "slots":  # routing in XLA, the kernels read slot arrays
                    w, idx = jax.lax.top_k(logits[i], k)
                    per_layer = jax.tree.map(lambda a: a.reshape(L, E, *a.shape[1:]), kx)
                    out.append(moe_decode.experts_forward(x[i], idx, jax.nn.softmax(w, axis=-1), per_layer,
                                                          jnp.int32(i), swiglu_limit=LIMIT, swiglu_alpha=ALPHA, **cfg))
                else:
                    words, xs = moe_decode.half_pairs(x[i])
                    out.append(moe_decode.run_routed(words, xs, logits[i], jnp.int32(i), kx, top_k=k,
                                                     swiglu_limit=LIMIT, swiglu_alpha=ALPHA, **cfg))
            return out
        jax.block_until_ready(step(x, logits, kx))
        for _ in range(reps):
            jax.block_until_ready(step(x, logits, kx))
        if not trace:  # under an external profiler (ncu): the kernels have run
            return dict(model=model, tokens=T, variant=name, cfg=cfg)
        trace_dir = tempfile.mkdtemp()
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        for _ in range(reps):
            jax.block_until_ready(step(x, logits, kx))
        jax.profiler.stop_trace()
    finally:
        for m, a, v in saved:
            setattr(m, a, v)
    per = {}
    for thread in summarize_trace(trace_dir).values():
        for row in thread["top"]:
            if "mxfp4" in row["name"]:
                per[row["name"]] = per.get(row["name"], 0.0) + row["us"] / (reps * L)
    gu_b, dn_b = expert_bytes(D, I)
    gu = sum(v for n, v in per.items() if "gate_up" in n)
    dn = sum(v for n, v in per.items() if "down" in n)
    return dict(model=model, tokens=T, variant=name, cfg=cfg, gate_up_us=gu, down_us=dn,
                gate_up_TBps=uniq * gu_b / gu / 1e6 if gu else 0.0, down_TBps=uniq * dn_b / dn / 1e6 if dn else 0.0,
                distinct_experts=uniq, kernels=per)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="20b,120b")
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--layers", default="20b=24,120b=8", help="layers of random experts per model")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variant", action="append", default=[], help="name:key=value,... (repeatable)")
    ap.add_argument("--no-trace", action="store_true", help="only run the variants (under ncu)")
    ap.add_argument("--out", default="probe_moe_gemv.json")
    args = ap.parse_args()
    variants = [("tree", {}, [])] + [parse_variant(v) for v in args.variant]
    layers = dict(item.split("=") for item in args.layers.split(","))
    bw = 1.0 if args.no_trace else copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for model in args.models.split(","):
        s = SHAPES[model]
        L = int(layers[model])
        kx = random_experts(L, s["E"], s["D"], s["I"])
        for T in [int(t) for t in args.tokens.split(",")]:
            for name, cfg_over, attrs in variants:
                try:
                    r = run_variant(model, T, L, kx, name, cfg_over, attrs, args.reps, not args.no_trace)
                except Exception as e:  # noqa: BLE001  (a variant that fails to compile: the sweep goes on)
                    print(f"{model} T={T} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                rows.append(r)
                if args.no_trace:
                    continue
                pct = lambda TBps: TBps * 1e12 / bw * 100  # noqa: E731
                print(f"{model:4s} T={T:2d} {name:14s} gate_up {r['gate_up_us']:6.1f} us {r['gate_up_TBps']:5.2f} "
                      f"TB/s ({pct(r['gate_up_TBps']):4.1f}%)  down {r['down_us']:6.1f} us {r['down_TBps']:5.2f} TB/s "
                      f"({pct(r['down_TBps']):4.1f}%)", flush=True)
        del kx
    Path(args.out).write_text(json.dumps(dict(device=jax.devices()[0].device_kind, copy_TBps=bw / 1e12, rows=rows),
                                         indent=1))


if __name__ == "__main__":
    main()
