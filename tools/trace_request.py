"""Where a request's time to its first token goes: the engine's steps on the host and the device's programs on one
clock.

    python -m tools.trace_request --preset gpt-oss-20b --speculative 3 --out trace_request.json
    python -m tools.trace_request --smoke      # tiny model: a CPU check of the script

The engine is built as tools.bench_speculative builds it: random weights, the `low_latency` profile, warmed up, and
with `--speculative K` the oracle drafter (forced acceptance, L = 3). One request runs untraced, so that every
program is loaded; then `--requests` run traced, one after another, without jax's Python tracer (whose spans of
every Python call slowed the host's steps ~1.7x). Each `engine.step` runs inside a `jax.profiler.TraceAnnotation`,
so the trace holds the host's steps and the device's kernels on one clock. For each traced request, in ms from its
`add_request`: every step's host span and the tokens it returned, then each device program's run (its kernels from
first start to last end, by XLA module), and when the first token arrived. The summary splits the first token's
time into host time before the first kernel, the programs, and what is left.
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from gptoss_jax import config, runtime
from gptoss_jax.engine import Engine
from gptoss_jax.sampling import SamplingParams
from pallas_kernels import KernelConfig
from tools.bench_throughput import SMOKE, SMOKE_ENGINE
from tools.common import commit_id, copy_bandwidth, perfetto_events, random_params, resolved


def trace_events(trace_dir: str) -> tuple[list[dict], list[dict], list[dict]]:
    """The perfetto trace under `trace_dir` -> (host spans of the annotations named `add_request` or `step N`,
    device kernels, every other host span: jax's and XLA's own), each `{"name", "start", "end"}` in us on the
    trace's clock; kernels also carry `module` (the XLA module that launched them)."""
    events, procs = perfetto_events(trace_dir)
    host, kernels, other = [], [], []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        span = {"name": e["name"], "start": e["ts"], "end": e["ts"] + e["dur"]}
        if "/device:" in procs.get(e["pid"], "") and "hlo_module" in e.get("args", {}):
            kernels.append({**span, "module": e["args"]["hlo_module"]})
        elif e["name"] == "add_request" or e["name"].startswith("step "):
            host.append(span)
        elif "/device:" not in procs.get(e["pid"], ""):
            other.append(span)
    return sorted(host, key=lambda s: s["start"]), sorted(kernels, key=lambda k: k["start"]), other


def program_runs(kernels: list[dict], gap_us: float = 200.0) -> list[dict]:
    """Kernels in start order -> program runs: a new run where the XLA module changes or the device idled more than
    `gap_us` (back-to-back calls of one program). Each `{"module", "start", "end", "kernels", "busy"}` (busy: the
    union of its kernels' intervals, us)."""
    runs = []
    for k in kernels:
        if not runs or runs[-1]["module"] != k["module"] or k["start"] - runs[-1]["end"] > gap_us:
            runs.append({"module": k["module"], "start": k["start"], "end": k["start"], "kernels": 0, "busy": 0.0})
        r = runs[-1]
        r["busy"] += max(0.0, k["end"] - max(k["start"], r["end"]))
        r["end"], r["kernels"] = max(r["end"], k["end"]), r["kernels"] + 1
    return runs


def request_timeline(
    host: list[dict], kernels: list[dict], returned: dict[str, int], first_step: str, other: list[dict] = ()
) -> dict:
    """One request's host steps and program runs, in ms from its `add_request` (the first host span), and the
    first token's time split: host before the first kernel, the runs that ended before it (busy, and span from
    the first's start to the last's end), and the time from that end to the token (reading it back, host work).
    `other` host spans that start before the first kernel are summed by name, the longest 15 (nested spans each
    count), to say what that host time was."""
    t0 = host[0]["start"]
    ms = lambda us: round((us - t0) / 1e3, 3)  # noqa: E731
    first = next(s["end"] for s in host if s["name"] == first_step)
    runs = [r for r in program_runs([k for k in kernels if t0 <= k["start"]]) if r["start"] < host[-1]["end"]]
    before = [r for r in runs if r["end"] <= first]  # the runs the first token could have waited for
    out = {
        "host": [
            {
                "name": s["name"],
                "start_ms": ms(s["start"]),
                "end_ms": ms(s["end"]),
                "tokens": returned.get(s["name"], 0),
            }
            for s in host
        ],
        "programs": [
            {
                "module": r["module"],
                "start_ms": ms(r["start"]),
                "end_ms": ms(r["end"]),
                "kernels": r["kernels"],
                "busy_ms": round(r["busy"] / 1e3, 3),
            }
            for r in runs
        ],
        "first_token_ms": ms(first),
    }
    if before:
        out["first_token_split_ms"] = {
            "host_before_first_kernel": ms(before[0]["start"]),
            "programs_busy": round(sum(r["busy"] for r in before) / 1e3, 3),
            "programs_span": round((before[-1]["end"] - before[0]["start"]) / 1e3, 3),
            "after_last_kernel": round((first - before[-1]["end"]) / 1e3, 3),
        }
        total, count = collections.Counter(), collections.Counter()
        for e in other:
            if t0 <= e["start"] < before[0]["start"]:
                total[e["name"][:80]] += min(e["end"], before[0]["start"]) - e["start"]
                count[e["name"][:80]] += 1
        out["host_before_first_kernel"] = [
            {"name": n, "ms": round(t / 1e3, 3), "count": count[n]} for n, t in total.most_common(15)
        ]
    return out


def run_request(engine: Engine, prompt: list[int], output_len: int, name: str) -> tuple[dict[str, int], str]:
    """One request to its end, each step annotated: (tokens each step returned, the first step that returned one)."""
    sp = SamplingParams(temperature=0, max_tokens=output_len, stop_token_ids=[])
    returned, first = {}, None
    with jax.profiler.TraceAnnotation("add_request"):
        engine.add_request(name, prompt, sp)
    i = 0
    while engine.has_unfinished_requests():
        i += 1
        with jax.profiler.TraceAnnotation(f"step {i}"):
            outs = engine.step()
        n = sum(len(o.new_token_ids) for o in outs)
        returned[f"step {i}"] = n
        if n and first is None:
            first = f"step {i}"
    return returned, first


def main() -> None:
    runtime.prepare()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-oss-20b")
    ap.add_argument("--smoke", action="store_true", help="tiny model, short request: a CPU check of the script")
    ap.add_argument("--speculative", type=int, default=0, help="K oracle drafts a step (0: no speculation)")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=16, help="tokens a request (the first few steps are the point)")
    ap.add_argument("--requests", type=int, default=2, help="traced requests, one after another")
    ap.add_argument("--config", default="low_latency", help="engine profile")
    ap.add_argument("--out", default="trace_request.json")
    args = ap.parse_args()
    overrides = {}
    if args.smoke:
        cfg = config.from_hf_dict(SMOKE)
        args.input_len, args.output_len, args.requests = 24, 6, 1
        overrides = dict(SMOKE_ENGINE, max_num_seqs=2)
    else:
        cfg = config.preset(args.preset)
    max_len = args.input_len + args.output_len
    overrides.update(max_model_len=max_len, min_context_bucket=max_len, min_prefill_bucket=min(args.input_len, 512))
    spec = None
    if args.speculative:
        spec = dict(
            method="oracle", num_speculative_tokens=args.speculative, acceptance_length=3.0, force_acceptance=True
        )
    kernels = resolved(KernelConfig())
    result = {
        "preset": "smoke" if args.smoke else args.preset,
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "commit": commit_id(),
        "speculative": args.speculative,
        "input_len": args.input_len,
        "config": args.config,
    }
    if jax.devices()[0].platform == "gpu":
        result["copy_bandwidth_tb_s"] = copy_bandwidth(warmup=1) / 1e12
        print(f"copy bandwidth {result['copy_bandwidth_tb_s']:.2f} TB/s", flush=True)
    params = random_params(cfg, kernels)
    engine = Engine(
        loaded=(cfg, params), config=args.config, progress=False, speculative_config=spec, warmup=True, **overrides
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, args.input_len).tolist() for _ in range(args.requests + 1)]
    run_request(engine, prompts[0], args.output_len, "untraced")
    result["requests"] = []
    for i, prompt in enumerate(prompts[1:]):
        folder = tempfile.mkdtemp()
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0  # its per-function spans slow the host several-fold: C++ spans only
        jax.profiler.start_trace(folder, create_perfetto_trace=True, profiler_options=options)
        t0 = time.perf_counter()
        returned, first = run_request(engine, prompt, args.output_len, f"traced-{i}")
        wall = time.perf_counter() - t0
        jax.profiler.stop_trace()
        host, kern, other = trace_events(folder)
        row = {"wall_s": wall, **request_timeline(host, kern, returned, first, other)}
        result["requests"].append(row)
        split = row.get("first_token_split_ms", {})
        print(
            f"[request {i}] first token {row['first_token_ms']:.2f} ms: "
            + ", ".join(f"{k} {v:.2f}" for k, v in split.items()),
            flush=True,
        )
        for s in row["host"][:4]:
            print(
                f"  host {s['name']:>12}: {s['start_ms']:8.2f} - {s['end_ms']:8.2f} ms, {s['tokens']} tokens",
                flush=True,
            )
        for r in row["programs"][:4]:
            print(
                f"  device {r['module'][:28]:>28}: {r['start_ms']:8.2f} - {r['end_ms']:8.2f} ms, "
                f"busy {r['busy_ms']:.2f} ms, {r['kernels']} kernels",
                flush=True,
            )
        for e in row.get("host_before_first_kernel", [])[:8]:
            print(f"  before the first kernel: {e['ms']:7.2f} ms in {e['count']:3d} x {e['name']}", flush=True)
    engine.close()
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
