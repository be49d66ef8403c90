"""Where a decode step's time goes: a `jax.profiler` trace of the engine's compiled decode step, summed
per GPU kernel, next to the step's wall time. `--prefill 8x1024` traces a prefill call instead (8 fresh
prompts of 1,024 tokens in one call, as the max_throughput profile packs them).

Same setup as tools/bench_decode.py (random weights in the kernels' layout, synthetic paged context);
one device call of `--steps` tokens is traced. The summary says how much of the wall time the GPU was
busy (the rest is launch gaps and host syncs), how many kernels one token launches, and the kernels
that cost most, by name. XLA flags (e.g. command buffers) are read at start-up, so compare them with
separate runs:

    XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true python tools/profile_decode.py --label dsf
    python tools/profile_decode.py --prefill 8x1024,2x1024

`--hlo-dump DIR` names each kernel's source: run with `XLA_FLAGS=--xla_dump_to=DIR` (plus
`--xla_dump_hlo_module_re=decode`) and the optimized HLO there gives each XLA fusion's shape and the JAX
operation (named scope included) it came from.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels  # noqa: E402

from ab_decode import parse_variant  # noqa: E402
from bench_decode import NUM_TOP, decode_call, model_config  # noqa: E402
from bench_reference import timeit  # noqa: E402
from gptoss_jax import model, steps  # noqa: E402
from gptoss_jax.random_weights import random_params  # noqa: E402


def summarize_trace(trace_dir: str, top: int = 60, timeline: int = 0) -> dict:
    """GPU kernel time from the perfetto trace `jax.profiler` wrote under `trace_dir`; with `timeline`, also
    that many consecutive kernels from the middle of the busiest stream: start (from the first), duration and
    the gap since the previous kernel ended (negative: they overlapped), which show where the step waits."""
    path = sorted(glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True))[-1]
    events = json.load(gzip.open(path))["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "GPU" in procs.get(e["pid"], "") and "dur" in e:
            by_thread[threads.get((e["pid"], e["tid"]), str(e["tid"]))].append(e)
    out = {}
    for name, evs in by_thread.items():
        evs.sort(key=lambda e: e["ts"])
        busy, end = 0.0, -1e30
        for e in evs:  # union of intervals
            s, f = e["ts"], e["ts"] + e["dur"]
            busy += max(0.0, f - max(s, end))
            end = max(end, f)
        totals, counts, args = collections.Counter(), collections.Counter(), {}
        for e in evs:
            totals[e["name"][:120]] += e["dur"]
            counts[e["name"][:120]] += 1
            args.setdefault(e["name"][:120], str(e.get("args", ""))[:300])
        out[name] = {"events": len(evs), "span_us": end - evs[0]["ts"], "busy_us": busy,
                     "top": [{"name": n, "us": t, "count": counts[n], "args": args[n]}
                             for n, t in totals.most_common(top)]}
    if timeline and out:
        name = max(out, key=lambda n: out[n]["busy_us"])
        evs = by_thread[name][len(by_thread[name]) // 2:][:timeline]
        ends = [e["ts"] + e["dur"] for e in evs]
        out[name]["timeline"] = [{"name": e["name"][:60], "start_us": round(e["ts"] - evs[0]["ts"], 2),
                                  "dur_us": e["dur"], "gap_us": round(e["ts"] - max(ends[:i]), 2) if i else 0.0}
                                 for i, e in enumerate(evs)]
    return out


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
            insts.setdefault(m.group(1).replace(".", "_"), (m.group(2)[:40], calls.group(1) if calls else None, op.group(1) if op else ""))
    out = {}
    for name, (shape, calls, op) in insts.items():
        ops = list(dict.fromkeys(comps.get(calls, []))) if calls else [_short(op)]
        out[name] = f"{shape}: {', '.join(ops)[:200]}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-oss-20b", help="preset name or a HF config.json path")
    ap.add_argument("--batch", default="1", help="comma-separated batch sizes")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--impl", default=pallas_kernels.default_impl(), choices=pallas_kernels.IMPLS)
    ap.add_argument("--temperature", type=float, default=0.0, help="every row's sampling temperature (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--prefill", default="", help="comma-separated ROWSxTOKENS prefill calls to trace instead")
    ap.add_argument("--label", default="baseline")
    ap.add_argument("--out", default="profile.json")
    ap.add_argument("--hlo-dump", default="", help="XLA dump directory: name each kernel's HLO source")
    ap.add_argument("--variant", default="", help="name:module.ATTR=value[,...]: constants set before tracing, "
                    "as in tools/ab_decode.py")
    ap.add_argument("--timeline", type=int, default=0, help="also list this many consecutive kernels of the "
                    "busiest stream, with the gap before each")
    args = ap.parse_args()
    if args.variant:
        args.label, sets = parse_variant(args.variant)
        for module, attr, value in sets:
            setattr(module, attr, value)
    cfg = model_config(args.preset)
    params = random_params(cfg, impl=args.impl)
    results = []
    if args.prefill:
        for spec in args.prefill.split(","):
            rows, T = (int(v) for v in spec.split("x"))
            run, free = prefill_call(params, cfg, rows, T, args.impl)
            results.append(profile(run, free, 1, f"prefill {rows}x{T}", "call", dict(rows=rows, tokens=T), args))
    else:
        for B in [int(b) for b in args.batch.split(",")]:
            run, free = decode_call(params, cfg, B, args.context, args.impl, args.steps, args.temperature, args.top_p)
            results.append(profile(run, free, args.steps, f"B={B} ctx={args.context} T={args.temperature} "
                                   f"top_p={args.top_p}", "token", dict(batch=B, context=args.context, steps=args.steps,
                                                                       temperature=args.temperature, top_p=args.top_p),
                                   args))
    if args.hlo_dump:
        sources = kernel_sources(args.hlo_dump)
        for r in results:
            for t in r["threads"].values():
                for row in t["top"]:
                    row["source"] = sources.get(row["name"], "")
                    print(f"  {row['name'][:40]:40s} {row['us'] / r.get('steps', 1):7.1f} us  "
                          f"{row['source']}")
    Path(args.out).write_text(json.dumps(results, indent=1))


def prefill_call(params, cfg, rows: int, T: int, impl: str):
    """`(run, free)` for one compiled prefill call of `rows` fresh `T`-token prompts."""
    pages = -(-T // 16)
    table = jnp.asarray(1 + np.arange(rows * pages, dtype=np.int32).reshape(rows, pages))
    tables = model.PageTables(table, table, jnp.zeros(rows, jnp.int32))
    state = {"cache": model.PagedKVCache.zeros(cfg, rows * pages + 1, rows * pages + 1, 16, params.embed.dtype)}
    tokens = jax.random.randint(jax.random.PRNGKey(T), (rows, T), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (rows, T))
    sp = steps.SamplingBatch(jnp.zeros(rows), jnp.zeros(rows, jnp.int32), jnp.ones(rows), jnp.zeros(rows),
                             jnp.zeros((rows, 2), jnp.uint32), jnp.zeros(rows, bool))

    last = jnp.full(rows, T - 1, jnp.int32)

    def run(block: bool = True):
        out, state["cache"] = steps.prefill(params, state["cache"], tokens, positions, tables, last, sp, cfg=cfg,
                                            impl=impl, num_top=NUM_TOP)
        return out.tokens.block_until_ready() if block else out.tokens

    def free():
        for buf in jax.tree.leaves(state["cache"]):
            buf.delete()

    return run, free


def profile(run, free, per: int, what: str, unit: str, meta: dict, args) -> dict:
    """Time and trace `run()`, which makes `per` units of work (decode tokens, or 1 prefill call)."""
    t0 = time.perf_counter()
    run()
    compile_s = time.perf_counter() - t0
    us = timeit(run, warmup=0, reps=args.reps) / per * 1e6
    # Host time until the call returns: near the device time means the call blocks the host (device-side
    # control flow such as `lax.cond` reads its predicate back), so nothing overlaps the next step's set-up.
    returns = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        out = run(block=False)
        returns.append(time.perf_counter() - t0)
        out.block_until_ready()
    dispatch_us = statistics.median(returns) * 1e6
    returns = []  # back to back, as the engine calls: the second call's cache is the first's, unfinished
    for _ in range(args.reps):
        run(block=False)
        t0 = time.perf_counter()
        out = run(block=False)
        returns.append(time.perf_counter() - t0)
        out.block_until_ready()
    chained_us = statistics.median(returns) * 1e6
    trace_dir = tempfile.mkdtemp()
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    t0 = time.perf_counter()
    run()
    traced_us = (time.perf_counter() - t0) * 1e6
    jax.profiler.stop_trace()
    summary = summarize_trace(trace_dir, timeline=args.timeline)
    free()
    result = {"label": args.label, "xla_flags": os.environ.get("XLA_FLAGS", ""), "preset": args.preset, **meta,
              "compile_s": compile_s, "us_per_" + unit: us, "dispatch_us_per_call": dispatch_us,
              "chained_dispatch_us_per_call": chained_us, "traced_us_per_" + unit: traced_us / per,
              "threads": summary}
    print(f"[{args.label}] {args.preset} {what}: {us:.0f} us per {unit}, traced "
          f"{traced_us / per:.0f} us, the call returns after {dispatch_us:.0f} us ({chained_us:.0f} us right after "
          f"another; compile {compile_s:.0f}s; "
          f"flags '{result['xla_flags']}')", flush=True)
    for name, t in summary.items():
        print(f"  {name}: {t['events'] / per:.0f} events/{unit}, busy {t['busy_us'] / per:.0f} us/{unit} "
              f"of span {t['span_us'] / per:.0f}", flush=True)
        for row in t["top"][:12]:
            print(f"    {row['us'] / per:8.1f} us/{unit}  x{row['count'] / per:5.1f}  {row['name'][:90]}")
        for row in t.get("timeline", []):
            print(f"    t={row['start_us']:8.2f}  {row['dur_us']:6.2f} us  gap {row['gap_us']:5.2f}  {row['name']}")
    return result


if __name__ == "__main__":
    main()
