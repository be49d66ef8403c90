import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp

from gptoss_jax import checkpoint

REPO = Path(__file__).resolve().parent.parent


def _run(*args):
    res = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_make_checkpoint_then_convert_then_restore(tmp_path):
    cfg = REPO / "tests" / "tiny_config.json"
    _run(REPO / "tools" / "make_checkpoint.py", "--config", cfg, "--out", tmp_path / "ck", "--layout", "original")
    assert (tmp_path / "ck" / "original" / "model.safetensors").exists()
    out = _run(REPO / "tools" / "convert_checkpoint.py", "--model", tmp_path / "ck", "--cache-dir", tmp_path / "cache")
    assert "ready" in out and len(list((tmp_path / "cache").iterdir())) == 1
    _, direct = checkpoint.load_params(tmp_path / "ck", jnp.bfloat16, progress=False)
    _, restored = checkpoint.load(tmp_path / "ck", jnp.bfloat16, cache_dir=tmp_path / "cache", progress=False)
    assert (direct.layers.experts.down_blocks == restored.layers.experts.down_blocks).all()
    assert (direct.unembed == restored.unembed).all()


def test_bench_throughput_smoke(tmp_path):
    """The throughput benchmark's whole path (random weights, jobs, latency run, JSON) on a tiny model."""
    import json

    _run(REPO / "tools" / "bench_throughput.py", "--smoke", "--out", tmp_path / "tp.json")
    result = json.loads((tmp_path / "tp.json").read_text())
    names = [j["job"] for j in result["jobs"]]
    assert names == ["throughput 24/16", "latency"]
    for job in result["jobs"]:
        assert job["output_tokens"] == job["requests"] * job["output_len"] and job["output_tok_s"] > 0
        assert job["host_s"].get("compiles", 0) == 0, job["host_s"]  # warm-up compiled every program it ran


def test_bench_sharded_smoke(tmp_path):
    """The sharded benchmark on 8 simulated devices: random weights in the kernels' layout, both dispatches."""
    import json

    _run(REPO / "tools" / "bench_sharded.py", "--smoke", "--mode", "max_throughput", "--dispatch", "both",
         "--batch", "2", "--layers", "2", "--context", "64", "--json", tmp_path / "s.json")
    rows = json.loads((tmp_path / "s.json").read_text())["results"]
    assert [(r["mode"], r["dispatch"], r["impl"]) for r in rows] == [
        ("max_throughput", "all_gather", "pallas"), ("max_throughput", "all_to_all", "pallas")]
    for r in rows:
        assert r["global_batch"] == 16 and r["devices"] == 8 and r["step_ms"] > 0
        assert abs(r["tok_s"] - 16e3 / r["step_ms"]) < 1e-6 * r["tok_s"]
        assert abs(r["tok_s_per_device"] * 8 - r["tok_s"]) < 1e-6 * r["tok_s"]
