"""Offline max-throughput jobs through `Engine`, as `trtllm-bench throughput` runs them, plus a batch-1
latency run.

Each `--jobs` entry `IN/OUT` submits `--num-requests` requests of IN random prompt tokens that each
produce exactly OUT tokens (stop tokens off, temperature 1), all at once, under the max_throughput
profile. Latency: one request under the low_latency profile. Prints output tokens/s, TTFT and TPOT
(time per output token after the first). Weights are random at the real shape, drawn on device in
the kernels' layout.

    python -m tools.bench_throughput --preset gpt-oss-20b --jobs 1024/1024x256,8192/1024x64 --out $OUT/tp.json
    python -m tools.bench_throughput --jobs 8192/1024x64,32768/1024x16 --skip latency --set kv_cache_dtype=fp8
    python -m tools.bench_throughput --smoke                                   # tiny model, CPU check
    python -m tools.bench_throughput --jobs 1024/1024x512 --set max_num_seqs=512 --set max_prefill_seqs=8
    python -m tools.bench_throughput --jobs '8192/1024x512,8192/1024x512:kv_cache_dtype=fp8;max_num_seqs=512'
    python -m tools.bench_throughput --jobs 1024/1024x256 --set 'kernels={moe_route_max_tokens: 0}'
    python -m tools.bench_throughput --jobs 1024/1024x256 --skip latency --trace-step 300   # GPU idle time, host split
    python -m tools.bench_throughput --skip throughput --latency-set 'kernels={moe_prefill_bf16_experts: true}'
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import yaml

from gptoss_jax import config, engine_config, runtime
from gptoss_jax import steps as steps_lib
from gptoss_jax.engine import Engine
from gptoss_jax.random_weights import DEMO_CONFIG
from gptoss_jax.sampling import SamplingParams
from pallas_kernels import KernelConfig
from pallas_kernels import params as params_lib
from tools.common import commit_id, copy_bandwidth, random_params, resolved, summarize_trace

SMOKE = dict(
    DEMO_CONFIG,
    num_hidden_layers=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    experts_per_token=2,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=64,
    head_dim=16,
    num_attention_heads=4,
    num_key_value_heads=2,
    sliding_window=8,
    eos_token_id=1,
    pad_token_id=0,
)
# Engine settings of the tools' `--smoke` runs on that model (a tool adds its own max_num_seqs).
SMOKE_ENGINE = dict(
    prefill_chunk_size=16, max_num_batched_tokens=64, page_size=4, kv_cache_tokens=1024, decode_steps_per_call=2
)


@contextlib.contextmanager
def _timer(totals: collections.Counter, part: str):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        totals[part] += time.perf_counter() - t0


class _Timed:
    """`obj` with the methods named in `parts` (method name -> part) timed into `totals`; the rest passes through."""

    def __init__(self, obj, totals: collections.Counter, **parts: str):
        self._obj, self._totals, self._parts = obj, totals, parts

    def __getattr__(self, name: str):
        attr = getattr(self._obj, name)
        if name not in self._parts:
            return attr

        def timed(*args, **kwargs):
            with _timer(self._totals, self._parts[name]):
                return attr(*args, **kwargs)

        return timed


class TimedEngine(Engine):
    """The engine with its host loop timed by part (seconds, in `timers`): `schedule`; `launch` (building a step's
    calls and dispatching them, of which `dispatch_prefill` / `dispatch_decode` are the model runner's calls:
    packing the inputs, and the jit calls); `collect` (reading a step's tokens and applying them, of which `wait`
    blocks on the device). With async scheduling a device-bound loop waits; a host-bound one, or one whose
    dispatch blocks, does not. Only this engine's own methods and members are wrapped (after its warm-up)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.timers: collections.Counter = collections.Counter()
        self.scheduler = _Timed(self.scheduler, self.timers, schedule="schedule")
        self.runner = _Timed(self.runner, self.timers, prefill="dispatch_prefill", decode="dispatch_decode")

    def _launch(self, work, drafted):
        with _timer(self.timers, "launch"):
            return super()._launch(work, drafted)

    def _collect(self, call):
        with _timer(self.timers, "collect"):
            with _timer(self.timers, "wait"):
                jax.block_until_ready((call.prefill_out, call.decode_out))
            return super()._collect(call)


def memory_facts(engine: TimedEngine, max_len: int, in_use: int | None) -> dict:
    """The KV cache's size (full-layer pages and tokens, how many sequences of the job's length fit at once) and the
    device memory around the job: in use once the engine is ready (weights and cache), the process's peak so far
    (the peak minus that is what the job's steps needed on top, for the first job of a run), and what XLA's memory
    analysis says the largest compiled step needs besides its arguments."""
    stats = jax.devices()[0].memory_stats() or {}
    tokens = engine.kv.capacity_tokens
    return {
        "kv_full_pages": engine.kv.full.num_pages,
        "kv_cache_tokens": tokens,
        "max_concurrent_seqs": tokens // max_len,
        "bytes_in_use_ready": in_use,
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "largest_step_temporaries": engine.runner.largest_temporaries()[1],
    }


def run_job(
    engine: TimedEngine, prompts: list[list[int]], output_len: int, trace: tuple[int, str] | None = None
) -> dict:
    """`trace=(step, dir)`: a `jax.profiler` trace of engine steps `step` to `step + 7` (fewer if the job
    ends first), summed per GPU kernel into the result (pick a step in the decode phase to see the
    device's idle time there). `host_s`: the engine's `timers`, and `compile` (seconds of XLA compilation during
    the job) with `compiles` (their count): after warm-up there should be none, and a program compiled again
    (say, for an argument that came back committed) does not show in `steps.TRACES`."""
    sp = SamplingParams(temperature=1.0, max_tokens=output_len, stop_token_ids=[], seed=0)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sp)
    first, last, n_out = {}, {}, 0
    steps = []  # (time, output tokens) per engine step: splits the job into its prefill and decode phases
    traced, t_trace = None, None

    def stop_trace():  # after 8 steps, or when the job ends sooner
        jax.block_until_ready(engine.runner.cache)
        jax.profiler.stop_trace()
        return {
            "first_step": trace[0],
            "steps": len(steps) - trace[0],
            "wall_us": (time.perf_counter() - t_trace) * 1e6,
        }

    with steps_lib.compilations() as compiled:
        while engine.has_unfinished_requests():
            if trace and len(steps) == trace[0]:
                jax.profiler.start_trace(trace[1], create_perfetto_trace=True)
                t_trace = time.perf_counter()
            outs = engine.step()
            now = time.perf_counter()
            steps.append((now, sum(len(o.new_token_ids) for o in outs)))
            if t_trace is not None and traced is None and len(steps) == trace[0] + 8:
                traced = stop_trace()
            for o in outs:
                n_out += len(o.new_token_ids)
                if o.new_token_ids:
                    first.setdefault(o.request_id, now)
                    last[o.request_id] = now
        if t_trace is not None and traced is None:
            traced = stop_trace()
    elapsed = time.perf_counter() - t0
    ttft = [first[r] - t0 for r in first]
    # Phase 1 ends when the last request has its first token: every prompt is prefilled; from then on the
    # steps only decode, at a batch that shrinks as requests finish.
    t_all = max(first.values()) if first else t0
    tok_1 = sum(n for t, n in steps if t <= t_all)
    tpot = [(last[r] - first[r]) / (output_len - 1) for r in first if output_len > 1]
    stats = engine.stats()
    if traced:
        traced["threads"] = summarize_trace(trace[1])
    host = dict(engine.timers, compile=sum(seconds for _, seconds in compiled), compiles=len(compiled))
    return {
        "host_s": host,
        "trace": traced,
        "requests": len(prompts),
        "input_len": len(prompts[0]),
        "output_len": output_len,
        "seconds": elapsed,
        "output_tokens": n_out,
        "output_tok_s": n_out / elapsed,
        "total_tok_s": (n_out + sum(map(len, prompts))) / elapsed,
        "ttft_s_median": statistics.median(ttft),
        "ttft_s_max": max(ttft),
        "tpot_ms_median": 1e3 * statistics.median(tpot) if tpot else None,
        "num_preemptions": stats.num_preemptions,
        "num_compiles": stats.num_compiles,
        "prefill_phase_s": t_all - t0,
        "prefill_phase_output_tokens": tok_1,
        "decode_phase_s": elapsed - (t_all - t0),
        "decode_phase_output_tokens": n_out - tok_1,
        "decode_phase_steps": sum(1 for t, n in steps if t > t_all and n),
    }


def parse_setting(item: str) -> tuple[str, object]:
    """`KEY=VALUE` (the value as YAML) from `--set` or a job's own settings."""
    key, eq, value = item.partition("=")
    if not eq or not key:
        raise ValueError(f"setting {item!r}: expected KEY=VALUE, e.g. max_num_seqs=512")
    return key, yaml.safe_load(value)


def parse_jobs(specs: str, num_requests: int, profile: str) -> list[tuple[str, str, int, int, int, dict]]:
    """`--jobs`: (name, profile, requests, input length, output length, the job's own settings) per entry."""
    jobs = []
    for spec in specs.split(","):
        job, _, own = spec.partition(":")
        lens, _, n = job.partition("x")
        try:
            inp, out = (int(v) for v in lens.split("/"))
            n = int(n or num_requests)
        except ValueError:
            raise ValueError(
                f"--jobs: '{spec}' is not INPUT/OUTPUT[xREQUESTS][:KEY=VALUE;...], e.g. 1024/1024x256"
            ) from None
        name = f"throughput {inp}/{out}" + (f" {own}" if own else "")
        jobs.append((name, profile, n, inp, out, dict(parse_setting(item) for item in own.split(";") if item)))
    return jobs


def main() -> None:
    runtime.prepare()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-oss-20b")
    ap.add_argument("--smoke", action="store_true", help="tiny model and job, for a CPU check of the script")
    ap.add_argument("--num-requests", type=int, default=256, help="requests of a job that names no count")
    ap.add_argument(
        "--jobs",
        default="1024/1024x256,8192/1024x64,32768/1024x16",
        help="comma-separated INPUT/OUTPUT[xREQUESTS][:KEY=VALUE;...] throughput jobs (each with its own engine "
        "settings, over --set's)",
    )
    ap.add_argument("--latency-input-len", type=int, default=1024)
    ap.add_argument("--latency-output-len", type=int, default=256)
    ap.add_argument("--throughput-config", default="max_throughput")
    ap.add_argument("--latency-config", default="low_latency")
    ap.add_argument(
        "--max-model-len",
        type=int,
        help="context of the engines, as a server's (its block tables are that wide); default: each job's own length",
    )
    ap.add_argument("--impl", choices=["pallas", "reference"], default=None, help="default: pallas on GPU")
    ap.add_argument("--skip", choices=["throughput", "latency"], help="leave out those jobs")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="engine setting (YAML value) for the throughput jobs, over the profile (repeatable); "
        "kernel settings: 'kernels={FIELD: VALUE, ...}'",
    )
    ap.add_argument(
        "--latency-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="engine setting (YAML value) for the latency job, over --latency-config (repeatable), e.g. "
        "'kernels={moe_prefill_bf16_experts: true}'",
    )
    ap.add_argument(
        "--trace-step",
        type=int,
        default=0,
        help="trace 8 engine steps of each throughput job from this one (0: no trace)",
    )
    ap.add_argument("--out", default="throughput.json")
    args = ap.parse_args()
    overrides = {}
    try:
        settings = dict(parse_setting(item) for item in args.set)
        latency_settings = dict(parse_setting(item) for item in args.latency_set)
    except ValueError as e:
        ap.error(str(e))
    if args.smoke:
        cfg = config.from_hf_dict(SMOKE)
        args.jobs, args.latency_input_len, args.latency_output_len = "24/16x8", 24, 16
        overrides = dict(SMOKE_ENGINE, max_num_seqs=4)
    else:
        cfg = config.preset(args.preset)
    try:
        jobs = parse_jobs(args.jobs, args.num_requests, args.throughput_config)
    except ValueError as e:
        ap.error(str(e))
    latency = "latency" + "".join(f" {item}" for item in args.latency_set)
    jobs.append((latency, args.latency_config, 1, args.latency_input_len, args.latency_output_len, latency_settings))
    kernels = resolved(KernelConfig(impl=args.impl or "auto"))
    result = {
        "preset": "smoke" if args.smoke else args.preset,
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "commit": commit_id(),
        "impl": kernels.impl,
        "jobs": [],
    }
    if not args.smoke:  # the ceiling, measured in the same run
        result["copy_TBps"] = copy_bandwidth(warmup=1) / 1e12
        print(f"copy bandwidth {result['copy_TBps']:.2f} TB/s", flush=True)
    t0 = time.perf_counter()
    params = random_params(cfg, kernels)
    jax.block_until_ready(params)
    result["param_bytes"] = params_lib.nbytes(params)
    print(f"random weights: {result['param_bytes'] / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f}s", flush=True)
    rng = np.random.default_rng(0)
    for name, profile, n, input_len, output_len, own_settings in jobs:
        if args.skip and name.startswith(args.skip):
            continue
        t0 = time.perf_counter()
        max_len = input_len + output_len
        job_settings = {**overrides, **(settings if name.startswith("throughput") else {}), **own_settings}
        # One block-table width (the job's length, or a server's `--max-model-len` with the profile's widths), and
        # prefill buckets from the prompt length up: a short fixed set of programs, no prompt padded past its length.
        chunk = engine_config.load(profile, **job_settings).prefill_chunk_size
        engine = TimedEngine(
            loaded=(cfg, params),
            config=profile,
            impl=args.impl,
            **{
                **job_settings,
                **(
                    {"max_model_len": max_len, "min_context_bucket": max_len}
                    if args.max_model_len is None
                    else {"max_model_len": args.max_model_len}
                ),
                "warmup": True,
                "min_prefill_bucket": min(input_len, chunk),
            },
        )
        warm = time.perf_counter() - t0
        print(
            f"[{name}] {profile}: engine ready (warm-up {warm:.1f}s, {engine.stats().num_compiles} programs, "
            f"{engine.kv.full.num_pages} full pages)",
            flush=True,
        )
        prompts = [rng.integers(0, cfg.vocab_size, input_len).tolist() for _ in range(n)]
        trace = (args.trace_step, tempfile.mkdtemp()) if args.trace_step and name.startswith("throughput") else None
        in_use = (jax.devices()[0].memory_stats() or {}).get("bytes_in_use")
        row = run_job(engine, prompts, output_len, trace)
        row.update(job=name, profile=profile, warmup_s=warm, config=dataclasses.asdict(engine.config))
        row.update(memory_facts(engine, max_len, in_use))
        result["jobs"].append(row)
        print(
            f"[{name}] {n} x ({input_len} in, {output_len} out): {row['output_tok_s']:.0f} output tok/s, "
            f"TTFT median {row['ttft_s_median'] * 1e3:.0f} ms, TPOT median {row['tpot_ms_median']:.2f} ms, "
            f"{row['num_preemptions']} preemptions",
            flush=True,
        )
        print(
            f"[{name}] phases: prefill {row['prefill_phase_s']:.1f}s, decode {row['decode_phase_s']:.1f}s "
            f"({row['decode_phase_steps']} steps); host: "
            + ", ".join(f"{k} {v:.1f}s" for k, v in sorted(row["host_s"].items()) if k != "compiles"),
            flush=True,
        )
        if row["host_s"].get("compiles"):
            print(
                f"[{name}] WARNING: {row['host_s']['compiles']} XLA compilations during the job "
                f"({row['host_s']['compile']:.1f}s): warm-up missed a program",
                flush=True,
            )
        if row["trace"]:
            for thread, t in row["trace"]["threads"].items():
                print(
                    f"[{name}] trace of {row['trace']['steps']} steps from step {args.trace_step}: {thread} busy "
                    f"{t['busy_us'] / 1e3:.1f} of {row['trace']['wall_us'] / 1e3:.1f} ms",
                    flush=True,
                )
        engine.close()
        del engine
        gc.collect()
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
