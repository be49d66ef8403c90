"""Start-up time of `serve` and `LLM`: from process start to ready (`/health` 200, the `LLM` built) and to the first
token, cold (an empty compilation cache) and warm (a restart on the cache the cold start filled), per profile.

    python -m tools.bench_startup --model /models/gpt-oss-20b --profiles max_throughput,low_latency --out $OUT/s.json
    python -m tools.bench_startup --preset gpt-oss-20b --entries serve   # writes a random checkpoint first
    python -m tools.bench_startup --smoke                                # the demo checkpoint, CPU

Each start is a fresh process, as a user's restart is; the server's /health is polled every 0.2 s and its loading
stages are recorded. `serve` needs the tokenizer's rank file (`--tokenizer` or `$TIKTOKEN_ENCODINGS_BASE`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

_LLM = """
import json, sys, time
t0 = time.time()
from jax import monitoring
from jax._src import dispatch
compiled, hits = [], []  # XLA's compile event fires for a program loaded from its persistent cache too
monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **kw: compiled.append(kw.get("fun_name")) if event == dispatch.BACKEND_COMPILE_EVENT
    else None)
monitoring.register_event_listener(
    lambda event, **kw: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None)
from gptoss_jax import LLM, SamplingParams
llm = LLM(sys.argv[1] or None, engine_config=sys.argv[2], compile_cache_dir=sys.argv[3], progress=False)
t1 = time.time()
llm.generate(prompt_token_ids=[[200006, 1428, 200008]], sampling_params=SamplingParams(temperature=0, max_tokens=1),
             use_tqdm=False)
print(json.dumps(dict(imported=t0, ready=t1, first_token=time.time(), compiled=len(compiled) - len(hits),
                      steps_compiled=sum(f in ("jit(decode)", "jit(prefill)") for f in compiled))))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_llm(model: str, profile: str, cache: Path) -> dict:
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", _LLM, model, profile, str(cache)], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"LLM start failed: {out.stderr[-3000:]}")
    t = json.loads(out.stdout.strip().splitlines()[-1])
    return dict(
        ready_s=t["ready"] - t0,
        first_token_s=t["first_token"] - t0,
        imports_s=t["imported"] - t0,
        xla_compilations=t["compiled"],  # not counting programs loaded from XLA's cache
        steps_compiled=t["steps_compiled"],
    )


def start_server(model: str, profile: str, cache: Path, tokenizer: str | None, log: Path, extra: list[str]) -> dict:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "gptoss_jax.serve",
        "--port",
        str(port),
        "--config",
        profile,
        "--compile-cache-dir",
        str(cache),
        "--log-level",
        "info",
    ] + (["--model", model] if model else [])
    cmd += (["--tokenizer", tokenizer] if tokenizer else []) + extra
    url, stages = f"http://127.0.0.1:{port}", {}
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with {proc.returncode}: {log.read_text()[-3000:]}")
                try:
                    health = httpx.get(url + "/health", timeout=2)
                except httpx.HTTPError:
                    time.sleep(0.2)
                    continue
                if health.status_code == 200:
                    break
                stages.setdefault(health.json().get("stage", "?"), round(time.time() - t0, 2))
                time.sleep(0.2)
            ready = time.time() - t0
            name = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            httpx.post(url + "/v1/completions", json=dict(model=name, prompt="Hello", max_tokens=1), timeout=300)
            first = time.time() - t0
        finally:
            proc.terminate()
            proc.wait(30)
    programs = [line for line in log.read_text().splitlines() if "programs ready" in line]
    return dict(ready_s=ready, first_token_s=first, stages_s=stages, warmup=programs[-1] if programs else None)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="checkpoint folder (default: the demo checkpoint, or --preset's)")
    ap.add_argument("--preset", help="write a random checkpoint of this preset first (tools.make_checkpoint)")
    ap.add_argument("--profiles", default="max_throughput,low_latency")
    ap.add_argument("--entries", default="serve,llm", help="serve, llm or both")
    ap.add_argument("--tokenizer", help="o200k_base.tiktoken (or its folder), for serve")
    ap.add_argument("--smoke", action="store_true", help="the demo checkpoint, low_latency only")
    ap.add_argument("--serve-args", default="", help="more flags for serve, e.g. '--compile-workers 4'")
    ap.add_argument("--out", default="startup.json")
    args = ap.parse_args(argv)
    if args.smoke:
        args.profiles = "low_latency"
    work = Path(tempfile.mkdtemp(prefix="bench_startup-"))
    if args.preset and not args.model:
        args.model = str(work / args.preset)
        t = time.time()
        subprocess.run(
            [sys.executable, "-m", "tools.make_checkpoint", "--preset", args.preset, "--out", args.model], check=True
        )
        print(f"random {args.preset} checkpoint written in {time.time() - t:.0f}s", flush=True)
    rows = []
    for profile in args.profiles.split(","):
        for entry in args.entries.split(","):
            cache = work / f"cache-{profile}-{entry}"
            for mode in ("cold", "warm"):
                log = work / f"{entry}-{profile}-{mode}.log"
                run = (
                    start_server(args.model, profile, cache, args.tokenizer, log, args.serve_args.split())
                    if entry == "serve"
                    else start_llm(args.model, profile, cache)
                )
                row = dict(entry=entry, profile=profile, mode=mode, **run)
                rows.append(row)
                print(
                    f"[{entry} {profile} {mode}] ready {row['ready_s']:.1f}s, first token {row['first_token_s']:.1f}s"
                    + (f", {row['xla_compilations']} XLA compilations" if "xla_compilations" in row else "")
                    + (f"; {row['warmup'].split(': ', 1)[-1]}" if row.get("warmup") else ""),
                    flush=True,
                )
    import jax

    result = dict(
        model=args.model or "demo",
        device=jax.devices()[0].device_kind,
        jax=jax.__version__,
        commit=os.environ.get("GPTOSS_JAX_COMMIT", "unknown"),
        cpus=os.cpu_count(),
        runs=rows,
    )
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
