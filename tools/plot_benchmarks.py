"""The pictures of docs/BENCHMARKS.md from the results files in docs/results/ (nothing else is drawn).

    python -m tools.plot_benchmarks [--results docs/results] [--out docs]

`benchmarks_curves.png`: today's figures only (the `CURRENT` files: the newest measurement of each job, the rows of
BENCHMARKS.md's first table), tok/s per user against output tok/s per GPU, one panel per model, with the memory
roofline per context length at the copy bandwidth measured in the same runs, and the published anchors. Every point
is named in the legend (value, job, commit), so no label sits on another.
`benchmarks_history.png`: how each job's output tok/s moved over the project, one line per (model, job), every
engine run in docs/results in the order the files were committed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import numpy as np

from gptoss_jax import config
from tools.common import decode_bytes

ROOT = Path(__file__).resolve().parent.parent
FP8_8K = "throughput 8192/1024 kv_cache_dtype=fp8;max_num_seqs=192"  # two waves of running requests, not one
FP8_8K_20B = "throughput 8192/1024 kv_cache_dtype=fp8;max_num_seqs=256"  # 512 requests: two waves
BF16_8K_20B = "throughput 8192/1024 max_num_seqs=256"
FP8_8K_PROFILE = "throughput 8192/1024 kv_cache_dtype=fp8"  # the profile's 256 running
BF16_8K_120B = "throughput 8192/1024 max_num_seqs=128"  # three waves
# (model, job in the file, results file): today's figures, BENCHMARKS.md's first table.
CURRENT = [
    ("20b", "latency", "latency_20b_b1_600716d_h200.json"),
    ("20b", "throughput 1024/1024", "engine_20b_bf16x_1k_h200.json"),
    ("20b", "throughput 8192/1024", "engine_20b_long_bf16kv_h200.json"),
    ("20b", FP8_8K_20B, "engine_20b_sched_h200.json"),
    ("20b", BF16_8K_20B, "engine_20b_8k_h200.json"),
    ("20b", "throughput 32768/1024", "engine_20b_long_bf16kv_h200.json"),
    ("120b", "latency", "latency_120b_b1_600716d_h200.json"),
    ("120b", "throughput 1024/1024", "engine_120b_1k_h200.json"),
    ("120b", "throughput 8192/1024", "engine_120b_8k_merged_h200.json"),
    ("120b", FP8_8K, "engine_120b_sched_h200.json"),
    ("120b", FP8_8K_PROFILE, "engine_120b_sizing_h200.json"),
    ("120b", BF16_8K_120B, "engine_120b_sizing_h200.json"),
]
# job -> (batch, mean context over the decode phase, bytes a cached value takes): where its point sits on the roofline
JOB_SHAPE = {
    "latency": (1, 1024 + 128, 2.0),
    "throughput 1024/1024": (256, 1024 + 512, 2.0),
    "throughput 8192/1024": (64, 8704, 2.0),
    "throughput 32768/1024": (16, 33280, 2.0),
    FP8_8K: (192, 8704, 1.0625),
    FP8_8K_20B: (256, 8704, 1.0625),
    BF16_8K_20B: (256, 8704, 2.0),
    FP8_8K_PROFILE: (256, 8704, 1.0625),
    BF16_8K_120B: (128, 8704, 2.0),
}
JOB_NAME = {
    "latency": "batch 1, 1k/256",
    "throughput 1024/1024": "256 x 1k/1k",
    "throughput 8192/1024": "64 x 8k/1k",
    "throughput 32768/1024": "16 x 32k/1k",
    FP8_8K: "384 x 8k/1k, FP8 KV, 192 running",
    FP8_8K_20B: "512 x 8k/1k, FP8 KV, 256 running",
    BF16_8K_20B: "512 x 8k/1k, 256 running",
    FP8_8K_PROFILE: "384 x 8k/1k, FP8 KV, 256 running",
    BF16_8K_120B: "384 x 8k/1k, 128 running",
}
# Published figures (not measured here): (model, label, device, output tok/s per GPU, tok/s per user or None, source)
ANCHORS = [
    ("20b", "vLLM c=1 (TPOT 3.58 ms)", "H200?", 275.9, 279.0, "vllm-project/vllm PR #37683"),
    ("20b", "vLLM v0.11 burst (TPOT 86.8 ms)", "H100", 9064.0, 1000 / 86.8, "gpustack performance lab"),
    ("20b", "TensorRT-LLM max, 1k/1k", "H200", 13890.0, None, "NVIDIA/TensorRT-LLM perf-overview"),
    ("20b", "TensorRT-LLM max, 8k/1k", "H200", 4015.0, None, "NVIDIA/TensorRT-LLM perf-overview"),
    ("120b", "SGLang bs1, TP8", "8xH100", 318.5 / 8, 318.5, "LMSYS blog 2025-08-27"),
    ("120b", "vLLM TP2 c=64 (TPOT 15.2 ms)", "2xH100", 2061.5, 1000 / 15.21, "InferenceX issue #828"),
    ("120b", "TensorRT-LLM max, 1k/1k", "H200", 6798.0, None, "NVIDIA/TensorRT-LLM perf-overview"),
    ("120b", "TensorRT-LLM max, 8k/1k", "H200", 1828.0, None, "NVIDIA/TensorRT-LLM perf-overview"),
]
MODELS = {"20b": "gpt-oss-20b", "120b": "gpt-oss-120b"}


def jobs(r: dict) -> list[dict]:
    """A file's job rows. The profile's 8k/1k job over 512 requests (its `max_num_seqs` is 256) is the job that
    earlier runs named with `max_num_seqs=256` set explicitly: one series, not the 64-request job of that name."""
    out = r.get("jobs") or [dict(r[k], job=k) for k in ("throughput", "latency") if r.get(k)]
    return [
        dict(j, job=BF16_8K_20B) if j.get("job") == "throughput 8192/1024" and j.get("requests", 64) == 512 else j
        for j in out
    ]


def current(results: Path) -> list[dict]:
    """One entry per `CURRENT` row: the job's figures, the file's device, commit and same-run copy bandwidth."""
    out = []
    for model, job, name in CURRENT:
        r = json.loads((results / name).read_text())
        (j,) = [j for j in jobs(r) if j["job"] == job]
        out.append(
            dict(
                model=model,
                job=job,
                file=name,
                commit=r["commit"],
                device=r["device"],
                copy_TBps=r["copy_TBps"],
                tok_s=j["output_tok_s"],
                tpot_ms=j["tpot_ms_median"],
            )
        )
    return out


def ceiling(model: str, job: str, copy_TBps: float) -> float:
    """The memory roofline of a job's decode steps in output tok/s per GPU at the same run's copy bandwidth."""
    batch, context, value_bytes = JOB_SHAPE[job]
    return batch * copy_TBps * 1e12 / decode_bytes(config.preset(MODELS[model]), batch, context, value_bytes)


def _added(path: Path) -> str:
    """The date and order a results file was committed (files are written once, by the run they hold)."""
    out = subprocess.run(
        ["git", "log", "--format=%cI", "--diff-filter=A", "--", path.name],
        cwd=path.parent,
        capture_output=True,
        text=True,
    ).stdout.split()
    return out[-1] if out else "9999"  # not committed yet: newest


def plot_current(results: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = current(results)
    fig, axes = plt.subplots(1, 2, figsize=(15, 10))
    batches = np.unique(np.round(np.logspace(0, 9, 80, base=2)).astype(int))
    for ax, (m, preset) in zip(axes, MODELS.items()):
        cfg = config.preset(preset)
        mine = [r for r in rows if r["model"] == m]
        bw = float(np.median([r["copy_TBps"] for r in mine])) * 1e12
        for context, style in ((1024, "-"), (8192, "--")):
            step = np.array([decode_bytes(cfg, int(b), context) for b in batches]) / bw
            ax.loglog(
                batches / step,
                1 / step,
                "k" + style,
                lw=1.2,
                label=f"memory roofline, context {context:,} (copy {bw / 1e12:.2f} TB/s, same runs)",
            )
        for r, marker in zip(mine, "osD^v<>ph", strict=False):  # up to 9 jobs a model
            user = 1e3 / r["tpot_ms"]
            ax.loglog(
                r["tok_s"],
                user,
                marker,
                ms=9,
                color="tab:blue",
                label=f"{JOB_NAME[r['job']]}: {r['tok_s']:,.0f} tok/s/GPU, {user:,.0f} tok/s/user ({r['commit'][:7]})",
            )
        lines = iter((":", "-."))
        for (_, label, dev, gpu, user, _), marker in zip([a for a in ANCHORS if a[0] == m], "*PX^v<>"):
            if user is None:
                ax.axvline(gpu, color="tab:red", ls=next(lines), lw=1, label=f"{label} [{dev}]: {gpu:,.0f} tok/s/GPU")
            else:
                ax.loglog(gpu, user, marker, color="tab:red", ms=10, label=f"{label} [{dev}]")
        ax.set_xlabel("output tok/s per GPU")
        ax.set_ylabel("tok/s per user (1 / median time per output token)")
        ax.set_title(f"{preset}, one {mine[0]['device']}: today's figures (blue), published (red)", fontsize=10)
        ax.set_xlim(20, 1e5)
        ax.set_ylim(5, 3e3)
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=1)  # below: the points stay visible
    fig.tight_layout()
    path = out / "benchmarks_curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_history(results: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[tuple[str, str], list[tuple[str, str, float]]] = {}  # (committed, file, tok/s)
    for f in results.glob("*.json"):
        r = json.loads(f.read_text())
        if "copy_TBps" not in r or "preset" not in r or "commit" not in r:
            continue
        m = "120b" if "120b" in r["preset"] else "20b"
        for j in jobs(r):
            if j.get("job") in JOB_SHAPE and j.get("output_tok_s"):
                series.setdefault((m, j["job"]), []).append((_added(f), f.name, j["output_tok_s"]))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, job in zip(axes, JOB_SHAPE):
        for m, color in (("20b", "tab:blue"), ("120b", "tab:orange")):
            pts = sorted(series.get((m, job), []))
            if pts:
                ax.plot(range(len(pts)), [p[2] for p in pts], "o-", color=color, label=f"gpt-oss-{m}")
                ax.annotate(f"{pts[-1][2]:,.0f}", (len(pts) - 1, pts[-1][2]), xytext=(4, 4), textcoords="offset points")
        ax.margins(x=0.12)
        ax.set_title(f"{JOB_NAME[job]}: output tok/s per run, oldest first", fontsize=10)
        ax.set_xlabel("engine runs in docs/results (order committed)")
        ax.grid(True, alpha=0.25)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "benchmarks_history.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.plot_benchmarks", description=__doc__.splitlines()[0])
    p.add_argument("--results", default=str(ROOT / "docs" / "results"))
    p.add_argument("--out", default=str(ROOT / "docs"))
    args = p.parse_args(argv)
    results, out = Path(args.results), Path(args.out)
    for r in current(results):
        print(
            f"{r['model']:<5} {JOB_NAME[r['job']]:<16} {r['tok_s']:>9,.0f} tok/s  TPOT {r['tpot_ms']:.2f} ms  "
            f"copy {r['copy_TBps']:.2f} TB/s  ceiling {ceiling(r['model'], r['job'], r['copy_TBps']):>9,.0f}  "
            f"{r['commit']}  {r['file']}"
        )
    print(plot_current(results, out))
    print(plot_history(results, out))


if __name__ == "__main__":
    main()
