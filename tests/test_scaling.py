"""The scaling tools: plan_mesh's bytes for both expert dispatches (CPU, simulated devices), the projection's
arithmetic on hand-computable inputs, and the rank-shape measuring tool (its routing, and its CPU smoke run)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tools import measure_rank_shapes as mrs
from tools import plan_mesh
from tools import project_scaling as ps

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "tests" / "tiny_config.json")  # D = 64, 4 experts, top-2, 2 layers


def _decode_plan(dispatch: str) -> dict:
    args = plan_mesh.parse_args(
        ["--preset", TINY, "--devices", "4", "--mode", "max_throughput", "--expert-dispatch", dispatch]
        + ["--batch", "8", "--context", "64", "--steps", "decode"]
    )
    return plan_mesh.plan(args)["steps"]["decode"]


@pytest.mark.slow  # two CPU compiles of the sharded decode step (~10 s, more on a busy machine)
def test_plan_mesh_counts_both_dispatches_as_a_gpu_sends_them():
    """4 devices, 8 tokens each, top-2 of 4 experts (one per device), D = 64, 2 layers. all_gather: the bf16
    tokens gathered (XLA:CPU carries them as f32; the planner counts 2 bytes), the f32 outputs reduce-scattered.
    all_to_all: the emulation's gathers are replaced by one ragged all-to-all each way of the 16 pairs a device
    sends (forward with its 2 bf16 id columns), its offset exchanges left out."""
    T, k, D, n, layers = 8, 2, 64, 4, 2
    ag = _decode_plan("all_gather")
    big = [c for c in ag["collectives"] if c["bytes"] >= T * D]  # each once per layer
    assert sorted((c["kind"], c["gpu_dtype"], c["bytes"]) for c in big) == layers * [
        ("all-gather", "bf16", n * T * D * 2)
    ] + layers * [("reduce-scatter", "f32", T * D * 4)]
    a2a = _decode_plan("all_to_all")
    ragged = [c for c in a2a["collectives"] if c["kind"] == "ragged-all-to-all"]
    assert sorted(c["bytes"] for c in ragged) == layers * [T * k * D * 2] + layers * [T * k * (D + 2) * 2]
    assert all(c["sent"] == c["bytes"] * (n - 1) // n and c["runs_full_model"] == layers // 2 for c in ragged)
    # The dispatch's own collectives (the sampler's small gathers of its per-slot state run in both dispatches).
    counted = [
        c for c in a2a["collectives"] if not c["emulation"] and not c["conditional"] and "/moe/" in c["where_full"]
    ]
    assert {c["kind"] for c in counted} == {"ragged-all-to-all", "all-gather"}
    assert all(c["bytes"] == n * n * 4 for c in counted if c["kind"] == "all-gather")  # the [n, n] pair counts
    rest = [
        c for c in a2a["collectives"] if not c["emulation"] and not c["conditional"] and "/moe/" not in c["where_full"]
    ]
    assert a2a["collectives_per_step"] == 3 * layers + len(rest)
    assert a2a["sent_bytes_per_device"] == sum(c["sent"] * c["runs_full_model"] for c in counted + rest)
    assert a2a["sent_bytes_per_token"] < ag["sent_bytes_per_token"]


def test_projection_arithmetic_by_hand():
    assert ps.step_seconds(3.0, 1.0, 0.0) == 4.0
    assert ps.step_seconds(3.0, 1.0, 1.0) == 3.0
    assert ps.step_seconds(3.0, 1.0, 0.5) == 3.5
    # collectives: latency per kind on 2 GPUs plus hops beyond (twice for an all-reduce), bytes over the link
    target = ps.Target("t", 1e12, 1e15, 1e9, 8, 1e8, 1e11, "test")
    latency = {"all-reduce": 2e-6, "all-gather": 1e-6, "ragged-all-to-all": 3e-6}
    s = ps.Settings(latency=latency, hop_latency=0.5e-6, link_efficiency=0.5)
    comm = ps.Comm({"all-gather": 10, "reduce-scatter": 10, "all-reduce": 5}, sent_per_token=1000, group=4)
    latency = 20 * (1e-6 + 2 * 0.5e-6) + 5 * (2e-6 + 4 * 0.5e-6)
    assert comm.seconds(100, s, target) == pytest.approx(latency + 1000 * 100 / (1e9 * 0.5))
    wide = ps.Comm({"ragged-all-to-all": 1}, sent_per_token=1000, group=16)  # beyond the NVLink domain
    assert wide.seconds(100, s, target) == pytest.approx(3e-6 + 14 * 0.5e-6 + 1000 * 100 / (1e8 * 0.5))
    # another GPU: byte-bound seconds by the HBM ratio, FLOP-bound by the matmul ratio, overhead unchanged
    assert ps.scaled((1.0, 2.0, 3.0), ps.TARGETS["GB200"]) == pytest.approx(1 + 2 * 4.8 / 8.0 + 3 * 989 / 2500)
    assert ps.scaled((1.0, 2.0, 3.0), ps.TARGETS["H200"]) == pytest.approx(6.0)
    # the compute model's fit recovers exact coefficients; a negative one is dropped (here the FLOP term)
    work = [(1e9, 1e8, 1e12), (5e9, 2e8, 1e12), (2e9, 9e8, 8e12), (7e9, 3e8, 3e13), (3e9, 5e9, 2e12)]
    t = lambda c0, w, kv, f: c0 + 2e-12 * w + 5e-12 * kv + 3e-15 * f  # noqa: E731
    models = ps.fit([("a", *x, t(1e-3, *x)) for x in work] + [("b", *x, t(4e-3, *x)) for x in work[:3]])
    a, b = models["a"], models["b"]  # rates shared, an overhead each
    assert (a.c0, a.s_per_byte, a.s_per_kv_byte, a.s_per_flop) == pytest.approx((1e-3, 2e-12, 5e-12, 3e-15), rel=1e-6)
    assert b.c0 == pytest.approx(4e-3, rel=1e-6) and b.s_per_flop == pytest.approx(a.s_per_flop)
    assert a.parts(1e9, 1e8, 1e12) == pytest.approx((1e-3, 2e-3 + 5e-4, 3e-3))
    m = ps.fit([("m", w, kv, f, 1e-3 + 2e-12 * w - 1e-16 * f) for w, kv, f in work])["m"]
    assert m.s_per_flop == 0 and min(m.c0, m.s_per_byte, m.s_per_kv_byte) >= 0
    assert ps._interp([(1, 1.0), (3, 5.0)], 2) == 3.0 and ps._interp([(1, 1.0), (3, 5.0)], 5) == 9.0
    # a job: 10 sequences, prefill 0.1 s, 50 steps of 20 ms, a rank of 2 GPUs: 500 tokens in 1.1 s, per GPU
    assert ps.output_tok_s_per_gpu(10, 50, 0.1, 0.02, 2) == pytest.approx(500 / 1.1 / 2)


def test_rank_times_from_a_measurement_by_hand(tmp_path):
    """t4 + 16 pairs (pair = t4 - t2) per batch, linear in batch and in context through the batch-64 pair, plus every
    layer's MoE as dispatched minus as the single-device step emulated it, held at the last measured tokens."""
    config = dict(
        model="m",
        mode="max_throughput",
        n=4,
        layers_full=36,
        decode=[
            dict(layers=2, batch=64, context=1024, ms=10.0),
            dict(layers=4, batch=64, context=1024, ms=16.0),
            dict(layers=2, batch=1, context=1024, ms=5.0),
            dict(layers=4, batch=1, context=1024, ms=7.0),
            dict(layers=2, batch=64, context=8192, ms=17.0),
        ],
        moe=[
            dict(step="decode", kind="emulated", tokens=1, ms_per_layer=0.1),
            dict(step="decode", kind="emulated", tokens=64, ms_per_layer=1.0),
            dict(step="decode", kind="all_gather", tokens=1, ms_per_layer=0.2),
            dict(step="decode", kind="all_gather", tokens=64, ms_per_layer=1.5),
        ],
    )
    path = tmp_path / "r.json"
    path.write_text(json.dumps(dict(configs=[config])))
    rt = ps.RankTimes(path)
    assert rt.has("m", "max_throughput", 4, "all_gather") and not rt.has("m", "max_throughput", 8, "all_gather")
    assert not rt.has("m", "max_throughput", 4, "all_to_all")  # its MoE was not timed
    ms = 1e3 * rt.decode_s("m", "max_throughput", 4, 64, 1024, "all_gather")
    assert ms == pytest.approx(4 + 18 * 6 + 36 * 0.5)
    ms = 1e3 * rt.decode_s("m", "max_throughput", 4, 64, 4608, "all_gather")  # halfway to 8192: pair 6 -> 9.5
    assert ms == pytest.approx(4 + 18 * 9.5 + 36 * 0.5)
    ms = 1e3 * rt.decode_s("m", "max_throughput", 4, 1, 1024, "all_gather")  # fixed 3, pair 2
    assert ms == pytest.approx(3 + 18 * 2 + 36 * 0.1)
    ms = 1e3 * rt.decode_s("m", "max_throughput", 4, 128, 1024, "all_gather")  # the step goes on, the MoE is held
    assert ms == pytest.approx(112 + 64 * (112 - 39) / 63 + 36 * 0.5)
    config["moe"] = config["moe"][1:]  # the emulated MoE at one token count only: no correction, no measured rank
    path.write_text(json.dumps(dict(configs=[config])))
    assert not ps.RankTimes(path).has("m", "max_throughput", 4, "all_gather")
    config["moe"] = [dict(step="decode", kind="emulated", tokens=1, ms_per_layer=0.1)] + config["moe"]
    config["decode"] = [r for r in config["decode"] if (r["layers"], r["batch"]) != (4, 64)]  # no fixed part at 64
    path.write_text(json.dumps(dict(configs=[config])))
    assert not ps.RankTimes(path).has("m", "max_throughput", 4, "all_gather")


def test_rank_times_floor_and_increment_by_hand(tmp_path):
    """With the compute models: a layer pair (and its growth with context) is never faster than its bytes at the
    run's copy bandwidth (the 2- and 4-layer steps both waiting on the host), and past the largest measured batch
    the step grows by the model's increment instead of the line through the last two batches (which falls here)."""
    cfg, mode, n = ps.config_lib.preset("gpt-oss-20b"), "max_throughput", 8
    two = ps.dataclasses.replace(cfg, num_layers=2)
    config = dict(
        model="gpt-oss-20b",
        mode=mode,
        n=n,
        layers_full=24,
        decode=[
            dict(layers=2, batch=1, context=1024, ms=1.00),
            dict(layers=4, batch=1, context=1024, ms=0.99),  # host-bound: t4 < t2
            dict(layers=2, batch=64, context=1024, ms=3.0),
            dict(layers=4, batch=64, context=1024, ms=5.0),  # pair 2 ms, far above its bytes
            dict(layers=2, batch=256, context=1024, ms=2.5),
            dict(layers=4, batch=256, context=1024, ms=4.0),  # cheaper than at 64
            dict(layers=2, batch=64, context=8192, ms=3.0),  # no growth measured: the KV bytes' floor
        ],
        moe=[
            dict(step="decode", kind=k, tokens=t, ms_per_layer=ms)
            for k, t, ms in (
                ("emulated", 1, 0.1),
                ("emulated", 64, 1.0),
                ("all_gather", 1, 0.1),
                ("all_gather", 64, 1.5),
            )
        ],
    )
    path = tmp_path / "r.json"
    path.write_text(json.dumps(dict(ceilings=dict(copy_Bps=4e12), configs=[config])))
    model = ps.ComputeModel(1e-3, 1e-12, 2e-12, 1e-15)
    rt = ps.RankTimes(path, {"gpt-oss-20b": model})
    w, kv, _ = ps.rank_work(two, mode, n, 1, 1024)
    floor = (w - 2 * cfg.vocab_size * cfg.hidden_size + kv) / 4e12
    assert 0.01e-3 < floor < 1e-3
    assert rt.decode_s("gpt-oss-20b", mode, n, 1, 1024, "all_gather") == pytest.approx(0.99e-3 + 10 * floor)
    assert rt.decode_s("gpt-oss-20b", mode, n, 64, 1024, "all_gather") == pytest.approx(25e-3 + 24 * 0.5e-3)
    grow = (ps.rank_work(two, mode, n, 64, 8192)[1] - ps.rank_work(two, mode, n, 64, 1024)[1]) / 4e12
    at_8k = rt.decode_s("gpt-oss-20b", mode, n, 64, 8192, "all_gather")
    assert grow > 0 and at_8k == pytest.approx(25e-3 + 12 * grow + 24 * 0.5e-3)
    inc = sum(model.parts(*ps.rank_work(cfg, mode, n, 640, 1024))) - sum(
        model.parts(*ps.rank_work(cfg, mode, n, 256, 1024))
    )
    at_640 = rt.decode_s("gpt-oss-20b", mode, n, 640, 1024, "all_gather")
    assert inc > 0 and at_640 == pytest.approx(4e-3 + 10 * 1.5e-3 + inc + 24 * 0.5e-3)
    assert ps.RankTimes(path).decode_s("gpt-oss-20b", mode, n, 640, 1024, "all_gather") < at_640  # the falling line


def test_validation_rows_cover_the_measured_runs():
    """Every 2- and 4-H200 run has a projection; the latencies fitted on the three 2-GPU batch-1 rows reproduce
    them exactly (3 unknowns, 3 rows), so their error is 0."""
    v = ps.validate(ps.Settings())
    assert len(v["rows"]) == 12
    fitted = [r for r in v["rows"] if r["fitted_on"]]
    assert len(fitted) == 3 and all(abs(r["error_pct"]) < 1e-6 for r in fitted)
    assert all(r["projected_ms"] > 0 and math.isfinite(r["error_pct"]) for r in v["rows"])


def test_dispatch_rows_deliver_what_the_mesh_delivers():
    """Rank 0 of 4 (8 experts: 2 each, top-4): the all-to-all buffer has capacity rows, the first T x k valid;
    the all-gather path n x T rows with the pairs of experts 0 and 1 valid."""
    from gptoss_jax import config as config_lib
    from gptoss_jax.random_weights import DEMO_CONFIG

    cfg = config_lib.from_hf_dict(dict(DEMO_CONFIG, **mrs.SMOKE))
    rng = np.random.default_rng(0)
    rows, ids, w, valid = mrs.dispatch_rows(cfg, "max_throughput", 4, "all_to_all", 4, rng)
    assert rows == 4 * 4 * 2 and valid.sum() == 16 and valid[:16].all() and ids.max() < 2
    assert (w == valid).all()
    rows, ids, w, valid = mrs.dispatch_rows(cfg, "max_throughput", 4, "all_gather", 4, rng)
    assert rows == 16 and ids.shape == (16, 4) and (ids < 2).all()
    assert (w[valid] == 0.25).all() and (w[~valid] == 0).all()
    rows, ids, w, valid = mrs.dispatch_rows(cfg, "low_latency", 4, "low_latency", 4, rng)  # the group's 4 tokens
    assert rows == 4 and ids.shape == (4, 4) and ((ids < 2) | ~valid).all() and (w[~valid] == 0).all()
    rank, info = mrs.rank_config(cfg, "low_latency", 2, 2)
    assert (rank.num_heads, rank.num_kv_heads, rank.num_experts, rank.experts_per_token) == (4, 2, 4, 4)
    assert info["vocab"] == cfg.vocab_size // 2 and rank.num_layers == 2
    assert mrs.rank_config(cfg, "max_throughput", 4, 4)[0].num_heads == cfg.num_heads


@pytest.mark.slow  # a tool run: tiny model, one rank config, every measurement (~40 s)
def test_measure_rank_shapes_smoke(tmp_path):
    out = tmp_path / "r.json"
    res = subprocess.run(
        [sys.executable, "-m", "tools.measure_rank_shapes", "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert res.returncode == 0, res.stderr
    d = json.loads(out.read_text())
    assert [(c["mode"], c["n"]) for c in d["configs"]] == [("max_throughput", 4)]
    [mt] = d["configs"]
    assert not mt.get("failed") and not mt["skipped"] and all(r["ms"] > 0 for r in mt["decode"])
    assert {(r["layers"], r["batch"], r["context"]) for r in mt["decode"]} == {(2, 4, 32), (4, 4, 32), (2, 4, 64)}
    assert {(m["step"], m["kind"]) for m in mt["moe"]} == {
        (step, kind) for step in ("decode", "prefill") for kind in ("emulated", "all_gather", "all_to_all")
    }
    assert len(mt["prefill"]) == 2
    rt = ps.RankTimes(out)
    assert rt.decode_s("smoke", "max_throughput", 4, 4, 48, "all_to_all") > 0
