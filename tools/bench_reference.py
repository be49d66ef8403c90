"""Baseline of the pure-JAX reference path on one GPU: write, load, prefill and decode at a real shape.

Writes a random MXFP4 checkpoint at the 20b (or 120b) shape to local disk, loads it through the
real loader (time, device memory), then times the engine's jitted prefill and decode steps on a paged
cache (`tools.common`'s steps). Ceilings are measured in the same run: device copy bandwidth (XLA, and
torch if present) and the bf16 matmul rate. Usage (on the GPU machine):

    python -m tools.bench_reference --preset gpt-oss-20b --out $OUT/reference.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from gptoss_jax import checkpoint, config, random_weights, runtime
from pallas_kernels import REFERENCE
from tools.common import (
    copy_bandwidth,
    decode_bytes,
    decode_step,
    matmul_rate,
    prefill_step,
    timeit,
    torch_copy_bandwidth,
)


def ceilings(copy_bytes: int = 4 << 30, n_mm: int = 8192) -> dict:
    out = {"xla_u32_add_TBps": copy_bandwidth(copy_bytes) / 1e12, "xla_bf16_matmul_TFLOPs": matmul_rate(n_mm) / 1e12}
    try:
        out["torch_copy_TBps"] = torch_copy_bandwidth() / 1e12
    except Exception as e:  # noqa: BLE001  (torch is optional: the XLA figure stands alone)
        out["torch_copy_error"] = repr(e)
    return out


def main() -> None:
    runtime.prepare()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-oss-20b", help="preset name, or a HF config.json path")
    ap.add_argument("--smoke", action="store_true", help="tiny ceilings, for a CPU check of the script")
    ap.add_argument("--ckpt-dir", default="/tmp/gptoss-random")
    ap.add_argument("--prefill", default="128,1024")
    ap.add_argument("--decode-batch", default="1,8,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", default="reference.json")
    args = ap.parse_args()

    result = {"preset": args.preset, "device": str(jax.devices()[0].device_kind), "jax": jax.__version__}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result["commit"] = commit or "unknown"
    result["ceilings"] = ceilings(4 << 20, 256) if args.smoke else ceilings()
    print("ceilings", result["ceilings"], flush=True)

    preset_file = Path(args.preset) if args.preset.endswith(".json") else config.PRESETS_DIR / f"{args.preset}.json"
    hf = json.loads(preset_file.read_text())
    t0 = time.perf_counter()
    path = random_weights.write_checkpoint(args.ckpt_dir, hf, seed=0)
    result["write_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    cfg, params = checkpoint.load_params(path, jnp.bfloat16)
    jax.block_until_ready(params)
    result["load_s"] = time.perf_counter() - t0
    stats = jax.devices()[0].memory_stats() or {}
    result["param_bytes"] = sum(x.nbytes for x in jax.tree.leaves(params))
    result["device_bytes_in_use_after_load"] = stats.get("bytes_in_use")
    result["device_peak_bytes_during_load"] = stats.get("peak_bytes_in_use")
    print(f"loaded in {result['load_s']:.1f}s; params {result['param_bytes'] / 2**30:.2f} GiB", flush=True)

    result["prefill"] = []
    for T in [int(t) for t in args.prefill.split(",")]:
        step = prefill_step(params, cfg, 1, T, REFERENCE, num_top=1)
        t = timeit(step, warmup=1, reps=5)
        step.free()
        result["prefill"].append({"tokens": T, "step_s": t, "tokens_per_s": T / t})
        print(f"prefill T={T}: {t * 1e3:.1f} ms ({T / t:.0f} tok/s)", flush=True)

    result["decode"] = []
    bw = max(result["ceilings"].get("torch_copy_TBps", 0), result["ceilings"]["xla_u32_add_TBps"]) * 1e12
    for B in [int(b) for b in args.decode_batch.split(",")]:
        step = decode_step(params, cfg, B, args.context, REFERENCE, num_top=1)
        t = timeit(step)
        step.free()
        need = decode_bytes(cfg, B, args.context)
        row = {
            "batch": B,
            "context": args.context,
            "step_s": t,
            "tok_per_s_per_user": 1 / t,
            "tok_per_s_total": B / t,
            "min_bytes": need,
            "roofline_fraction": need / t / bw,
        }
        result["decode"].append(row)
        print(
            f"decode B={B} ctx={args.context}: {t * 1e3:.2f} ms/step, {B / t:.0f} tok/s total, "
            f"{100 * row['roofline_fraction']:.1f}% of copy-bandwidth roofline",
            flush=True,
        )
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
