"""Where a decode step's time goes: a `jax.profiler` trace of the engine's compiled decode step, summed
per GPU kernel, next to the step's wall time. `--prefill 8x1024` traces a prefill call instead (8 fresh
prompts of 1,024 tokens in one call, as the max_throughput profile packs them), or as well with `--batch`.

Same setup as tools.bench_decode (random weights in the kernels' layout, synthetic paged context);
one device call of `--steps` tokens is traced. The summary says how much of the wall time the GPU was
busy (the rest is launch gaps and host syncs), how many kernels one token launches, and the kernels
that cost most, by name. XLA flags (e.g. command buffers) are read at start-up, so compare them with
separate runs:

    XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true python -m tools.profile_decode --label dsf
    python -m tools.profile_decode --prefill 8x1024,2x1024
    python -m tools.profile_decode --prefill 8x2048@6144 --kv-cache-dtype fp8   # chunks after 6,144 cached tokens
    python -m tools.profile_decode --variant triton:mosaic=false --batch 64
    python -m tools.profile_decode --prefill 1x1024,2x8192 --variant bf16x:moe_prefill_bf16_experts=true
    python -m tools.profile_decode --speculative 3      # verify steps of 3 oracle drafts per row

`--hlo-dump DIR` names each kernel's source: run with `XLA_FLAGS=--xla_dump_to=DIR` (plus
`--xla_dump_hlo_module_re=decode`) and the optimized HLO there gives each XLA fusion's shape and the JAX
operation (named scope included) it came from.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import jax

from gptoss_jax import runtime, speculative
from gptoss_jax.engine_config import EngineConfig
from pallas_kernels import KernelConfig, kv_quant
from tools.common import (
    copy_bandwidth,
    decode_step,
    model_config,
    parse_variants,
    prefill_step,
    random_params,
    resolved,
    speculative_step,
    summarize_trace,
    timeit,
)


def _short(op_name: str) -> str:
    """An op_name without the jit/scan nesting above the innermost scan body."""
    return op_name.split("body/eval_jaxpr/")[-1]


def kernel_sources(dump_dir: str) -> dict:
    """Kernel name -> "shape: op, op, ..." from the dumped optimized HLO: the instruction of that name and, for
    a fusion, the JAX operations (`op_name` from the innermost scan body down, named scopes included) it fused."""
    inst_re = re.compile(r"^\s*(?:ROOT )?%?([\w.-]+) = (\S+) ")
    comps, insts, comp = collections.defaultdict(list), {}, None
    for path in glob.glob(f"{dump_dir}/*after_optimizations.txt"):
        for line in Path(path).read_text().splitlines():
            head = re.match(r"^%?([\w.-]+) .*\{$", line)
            if head and not line.startswith(" "):
                comp = head.group(1)
                continue
            m = inst_re.match(line)
            if not m:
                continue
            op = re.search(r'op_name="([^"]*)"', line)
            if op:
                comps[comp].append(_short(op.group(1)))
            calls = re.search(r"calls=%?([\w.-]+)", line)
            insts.setdefault(
                m.group(1).replace(".", "_"),
                (m.group(2)[:40], calls.group(1) if calls else None, op.group(1) if op else ""),
            )
    out = {}
    for name, (shape, calls, op) in insts.items():
        ops = list(dict.fromkeys(comps.get(calls, []))) if calls else [_short(op)]
        out[name] = f"{shape}: {', '.join(ops)[:200]}"
    return out


def main() -> None:
    runtime.prepare()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-oss-20b", help="preset name or a HF config.json path")
    ap.add_argument(
        "--batch", default=None, help="comma-separated batch sizes (default 1; with --prefill, none unless given)"
    )
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--impl",
        default="auto",
        choices=("auto", "pallas", "reference"),
        help="auto: the kernels on GPUs, the reference elsewhere",
    )
    ap.add_argument("--temperature", type=float, default=0.0, help="every row's sampling temperature (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument(
        "--conditionals",
        action="store_true",
        help="greedy rows too take the program with the sampler's conditionals (the engine's greedy calls of up to "
        "greedy_program_rows rows do not)",
    )
    ap.add_argument(
        "--prefill",
        default="",
        help="comma-separated ROWSxTOKENS[@START] prefill calls to trace (chunks at positions START..)",
    )
    ap.add_argument("--kv-cache-dtype", default="auto", choices=sorted(kv_quant.DTYPES), help="the cache's pools")
    ap.add_argument(
        "--speculative",
        type=int,
        default=0,
        help="trace verify steps of this many oracle drafts per row (steps.decode_speculative) instead",
    )
    ap.add_argument(
        "--no-draft",
        action="store_true",
        help="with --speculative: the step of a call with more requests enqueued than disable_by_batch_size (one "
        "token per row, no drafts)",
    )
    ap.add_argument("--label", default="baseline")
    ap.add_argument("--out", default="profile.json")
    ap.add_argument("--hlo-dump", default="", help="XLA dump directory: name each kernel's HLO source")
    ap.add_argument(
        "--variant",
        default="",
        help="NAME:field=value[,...]: KernelConfig fields, as in tools.ab_decode; NAME becomes the label",
    )
    ap.add_argument(
        "--timeline",
        type=int,
        default=0,
        help="also list this many consecutive kernels of the busiest stream, with the gap before each",
    )
    args = ap.parse_args()
    kernels = KernelConfig(impl=args.impl)
    if args.variant:
        [(args.label, kernels)] = parse_variants(ap, [args.variant], kernels)
    kernels = resolved(kernels)
    copy = copy_bandwidth(2 << 30, warmup=1, reps=5, calls=10)  # the ceiling, measured in the same run
    print(f"copy bandwidth {copy / 1e12:.2f} TB/s", flush=True)
    cfg = model_config(args.preset)
    params = random_params(cfg, kernels)
    kv_dtype = kv_quant.DTYPES[args.kv_cache_dtype]
    results = []
    for spec in args.prefill.split(",") if args.prefill else []:
        shape, _, start = spec.partition("@")
        rows, T = (int(v) for v in shape.split("x"))
        step = prefill_step(params, cfg, rows, T, kernels, start=int(start or 0), kv_dtype=kv_dtype)
        meta = dict(rows=rows, tokens=T, start=int(start or 0), kv_cache_dtype=args.kv_cache_dtype)
        results.append(profile(step, 1, f"prefill {spec} kv {args.kv_cache_dtype}", "call", meta, args))
    batches = args.batch or ("" if args.prefill else "1")
    for B in [int(b) for b in batches.split(",") if b]:
        plain = args.temperature == 0 and B <= EngineConfig().greedy_program_rows and not args.conditionals
        if args.speculative:
            spec = speculative.SpeculativeConfig("oracle", args.speculative)
            drafter = speculative.make_drafter(spec, cfg.vocab_size, args.context + args.steps * 8 + 8)
            step = speculative_step(
                params,
                cfg,
                B,
                args.context,
                kernels,
                drafter,
                num_steps=args.steps,
                draft_params=drafter.params(spec),
                draft=not args.no_draft,
                plain=plain,
            )
            what = f"B={B} ctx={args.context} {'no-draft' if args.no_draft else 'verify'} k={args.speculative}"
            meta = dict(batch=B, context=args.context, steps=args.steps, speculative=args.speculative)
            meta.update(draft=not args.no_draft, plain=plain)
            results.append(profile(step, args.steps, what, "verify_step", meta, args))
            continue
        step = decode_step(
            params,
            cfg,
            B,
            args.context,
            kernels,
            num_steps=args.steps,
            temperature=args.temperature,
            top_p=args.top_p,
            kv_dtype=kv_dtype,
            plain=plain,
        )
        results.append(
            profile(
                step,
                args.steps,
                f"B={B} ctx={args.context} T={args.temperature} top_p={args.top_p} kv {args.kv_cache_dtype}",
                "token",
                dict(
                    batch=B,
                    context=args.context,
                    steps=args.steps,
                    temperature=args.temperature,
                    top_p=args.top_p,
                    kv_cache_dtype=args.kv_cache_dtype,
                    plain=plain,
                ),
                args,
            )
        )
    if args.hlo_dump:
        sources = kernel_sources(args.hlo_dump)
        for r in results:
            for t in r["threads"].values():
                for row in t["top"]:
                    row["source"] = sources.get(row["name"], "")
                    print(f"  {row['name'][:40]:40s} {row['us'] / r.get('steps', 1):7.1f} us  {row['source']}")
    Path(args.out).write_text(json.dumps([dict(r, copy_tb_s=copy / 1e12) for r in results], indent=1))


def profile(step, per: int, what: str, unit: str, meta: dict, args) -> dict:
    """Time and trace `step` (a `common.Step`), whose call makes `per` units of work (decode tokens, or 1
    prefill call)."""
    t0 = time.perf_counter()
    step()
    compile_s = time.perf_counter() - t0
    us = timeit(step, warmup=0, reps=args.reps) / per * 1e6
    # Host time until the call returns: near the device time means the call blocks the host (device-side
    # control flow such as `lax.cond` reads its predicate back), so nothing overlaps the next step's set-up.
    returns = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        out = step(block=False)
        returns.append(time.perf_counter() - t0)
        out.block_until_ready()
    dispatch_us = statistics.median(returns) * 1e6
    returns = []  # back to back, as the engine calls: the second call's cache is the first's, unfinished
    for _ in range(args.reps):
        step(block=False)
        t0 = time.perf_counter()
        out = step(block=False)
        returns.append(time.perf_counter() - t0)
        out.block_until_ready()
    chained_us = statistics.median(returns) * 1e6
    trace_dir = tempfile.mkdtemp()
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    t0 = time.perf_counter()
    step()
    traced_us = (time.perf_counter() - t0) * 1e6
    jax.profiler.stop_trace()
    summary = summarize_trace(trace_dir, timeline=args.timeline)
    step.free()
    result = {
        "label": args.label,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "preset": args.preset,
        **meta,
        "compile_s": compile_s,
        "us_per_" + unit: us,
        "dispatch_us_per_call": dispatch_us,
        "chained_dispatch_us_per_call": chained_us,
        "traced_us_per_" + unit: traced_us / per,
        "threads": summary,
    }
    print(
        f"[{args.label}] {args.preset} {what}: {us:.0f} us per {unit}, traced "
        f"{traced_us / per:.0f} us, the call returns after {dispatch_us:.0f} us ({chained_us:.0f} us right after "
        f"another; compile {compile_s:.0f}s; "
        f"flags '{result['xla_flags']}')",
        flush=True,
    )
    for name, t in summary.items():
        print(
            f"  {name}: {t['events'] / per:.0f} events/{unit}, busy {t['busy_us'] / per:.0f} us/{unit} "
            f"of span {t['span_us'] / per:.0f}",
            flush=True,
        )
        for row in t["top"][:12]:
            print(f"    {row['us'] / per:8.1f} us/{unit}  x{row['count'] / per:5.1f}  {row['name'][:90]}")
        for row in t.get("gaps", [])[:6]:
            idle = f"    idle {row['us'] / per:6.1f} us/{unit}  x{row['count'] / per:5.1f}"
            print(f"{idle}  {row['after']} -> {row['before']}")
        for row in t.get("timeline", []):
            print(f"    t={row['start_us']:8.2f}  {row['dur_us']:6.2f} us  gap {row['gap_us']:5.2f}  {row['name']}")
    return result


if __name__ == "__main__":
    main()
