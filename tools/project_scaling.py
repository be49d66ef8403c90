"""Projected output tokens/s per GPU of gpt-oss on 1 to 72 GPUs: one-GPU times, the collectives `tools.plan_mesh`
finds in the compiled steps, the targets' bandwidths and an explicit overlap assumption.

    python -m tools.project_scaling                          # tables: validation, then the projection
    python -m tools.project_scaling --overlap 0.8 --json docs/results/scaling_projection.json
    python -m tools.project_scaling --rank-shapes docs/results/rank_shapes_h200.json   # measured rank times

A decode step of one rank (a replica group in low_latency, one GPU in max_throughput) takes

    step = compute + comm - overlap * min(compute, comm)

* compute: the rank's own work on one H200. Either measured at the rank's shapes (`--rank-shapes`, the JSON of
  `tools.measure_rank_shapes`), or a three-term model fitted to one-GPU step times (`CALIBRATIONS`):
  `c0 + bytes / bw + flops / mm`, with the bytes the rank must read (its attention weights, the routed experts it
  holds that its tokens touch under uniform routing, the router, its KV and unembedding share) and its matmul
  FLOPs (`rank_work`). On another GPU the byte term scales by the HBM ratio and the FLOP term by the bf16 matmul
  ratio (`TARGETS`); measured times are split in the model's proportions at the same shape.
* comm: for each collective of the step (`plan_mesh` JSON in docs/results/plan_mesh/, per kind) a fixed latency,
  plus the bytes one GPU sends / (link bandwidth x `--link-efficiency`): NVLink inside a target's NVLink domain,
  the scale-out network across domains.
* prefill: one-GPU prefill rate at the job's prompt length (`CALIBRATIONS`, per GPU: a rank does the same work
  per token on each GPU), FLOP-bound so scaled by the matmul ratio, plus its collectives.

A job `ISL/OSL` at `B` sequences per rank: output tok/s per GPU = B x OSL / (B x ISL x prefill per token +
OSL x step at context ISL + OSL / 2) / GPUs per rank. max_throughput takes the largest batch up to `--max-batch`
(640: NVIDIA's NVL72 figure) whose KV cache fits beside the weights; low_latency reports batch 1 and 8 per group.

Validation (`validate`): the 2- and 4-H200 decode steps of docs/results/sharded_120b_h200x4_kernels_valid.json
(commit 024b625) against the projection with the one-GPU times of the same days (decode_gemv16_h200.json, commit
545f9da) and no overlap (the engine overlaps nothing); the collective latencies are fitted on the 2-GPU rows and
checked on the 4-GPU rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from gptoss_jax import config as config_lib

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"
PLANS = RESULTS / "plan_mesh"
# tools.measure_rank_shapes on one H200: the 1-, 8- and 72-GPU ranks, and gpt-oss-120b's 2- and 4-GPU ranks
RANK_SHAPES = (RESULTS / "rank_shapes_h200.json", RESULTS / "rank_shapes_2_4_h200.json")


@dataclasses.dataclass(frozen=True)
class Target:
    """One GPU kind: HBM bandwidth and dense bf16 matmul rate (data sheet), NVLink bandwidth per direction per GPU,
    how many GPUs one NVLink domain holds, the scale-out bandwidth per GPU per direction beyond it, memory."""

    name: str
    hbm_Bps: float
    bf16_flops: float
    nvlink_Bps: float
    nvlink_domain: int
    scaleout_Bps: float
    memory_bytes: float
    source: str


TARGETS = {
    "H200": Target(
        "H200 SXM, HGX 8-GPU, NVLink 4",
        4.8e12,
        989e12,
        450e9,
        8,
        50e9,
        141e9,
        "NVIDIA H200 data sheet: 4.8 TB/s HBM3e, 141 GB, 989 TFLOPS dense BF16, NVLink 900 GB/s (450 each way); "
        "scale-out one 400 Gb/s ConnectX-7 per GPU (50 GB/s)",
    ),
    "B200": Target(
        "B200, HGX 8-GPU, NVLink 5",
        8.0e12,
        2250e12,
        900e9,
        8,
        50e9,
        180e9,
        "NVIDIA HGX B200 data sheet: 8 TB/s HBM3e, 180 GB, 2.25 PFLOPS dense BF16, NVLink 5 1.8 TB/s (900 each way)",
    ),
    "GB200": Target(
        "GB200 NVL72 (one rack, 72 GPUs in one NVLink domain)",
        8.0e12,
        2500e12,
        900e9,
        72,
        900e9,
        186e9,
        "NVIDIA GB200 NVL72 data sheet: per GPU 8 TB/s HBM3e, 186 GB, 2.5 PFLOPS dense BF16 (5 sparse), NVLink 5 "
        "1.8 TB/s (900 each way), all 72 GPUs on one NVLink switch domain",
    ),
}
MEASURED_ON = "H200"  # every one-GPU time below

# One-GPU decode steps and prefill rates on one H200, per era (the code of the runs they are compared with).
CALIBRATIONS = {
    # the days of the 2-/4-GPU runs: bench_decode at commit 545f9da, 8 tokens per device call, context 1,024
    "2026-11-22": dict(source="docs/results/decode_gemv16_h200.json (commit 545f9da, bench_decode)"),
    # today's engine: the jobs of BENCHMARKS.md "Today's figures" (bench_throughput); decode = the decode phase's
    # seconds per output token of one sequence (TPOT medians also hold the prefill chunks interleaved with decode)
    "today": dict(
        source="docs/results/engine_{120b_b1_back,120b_linear_mosaic,120b_8k_merged,20b_b1_startup,20b_1k_merged,"
        "20b_long_bf16kv}_h200.json (bench_throughput, commits 6982902 .. fad91a3)",
        files={
            "gpt-oss-120b": (
                "engine_120b_b1_back_h200.json",
                "engine_120b_linear_mosaic_h200.json",
                "engine_120b_8k_merged_h200.json",
            ),
            "gpt-oss-20b": (
                "engine_20b_b1_startup_h200.json",
                "engine_20b_1k_merged_h200.json",
                "engine_20b_long_bf16kv_h200.json",
            ),
        },
    ),
}
JOBS = ((1024, 1024), (8192, 1024))
MESHES = {  # N -> (replicas, model) per mode; 72 GPUs: attention TP stops at 8 (docs/SCALING.md)
    "low_latency": {1: [(1, 1)], 2: [(1, 2)], 4: [(1, 4)], 8: [(1, 8)], 72: [(9, 8)]},
    "max_throughput": {1: [(1, 1)], 2: [(1, 2)], 4: [(1, 4)], 8: [(1, 8)], 72: [(9, 8), (1, 72)]},
}


# ---- the rank's work ---------------------------------------------------------------------------------------------


def rank_work(cfg: config_lib.ModelConfig, mode: str, n: int, batch: int, context: int) -> tuple[float, float, float]:
    """(weight bytes read, KV bytes read, matmul FLOPs) of one decode step of one GPU of a rank of `n` GPUs:
    low_latency splits heads (when `n` divides the KV heads), vocabulary (when it divides) and experts over the
    group, whose `batch` tokens every GPU sees; max_throughput keeps attention and vocabulary whole and splits the
    experts, the GPU seeing all `n x batch` tokens' routing and getting `batch x k` pairs on average."""
    D, I, E, k, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.experts_per_token, cfg.num_layers
    H, Nq, K, V = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size
    ll = mode == "low_latency"
    tp = n if ll and K % n == 0 else 1
    tpv = n if ll and V % n == 0 else 1
    attn_params = D * H * (Nq + 2 * K) + Nq * H * D
    expert_bytes = (3 * I * D) * 4.25 / 8 + 2 * (2 * I + D)
    local = E / n  # real experts per GPU on average (padding experts are never routed to)
    seen = batch if ll or n == 1 else n * batch
    touched = local * (1 - (1 - k / E) ** seen)
    pairs = batch * k / n if ll else batch * k
    kv_tok = 2 * K * H * 2 / tp
    ctx = [min(context, cfg.sliding_window) if cfg.is_sliding(layer) else context for layer in range(L)]
    weights = L * (2 * attn_params / tp + 2 * E * D + touched * expert_bytes) + 2 * V * D / tpv
    flops = L * (2 * batch * attn_params / tp + 6 * D * I * pairs) + 4 * batch * H * Nq / tp * sum(ctx)
    flops += 2 * batch * V * D / tpv
    return weights, batch * kv_tok * sum(ctx), flops


def kv_bytes_per_sequence(cfg: config_lib.ModelConfig, mode: str, n: int, context: int) -> float:
    tp = n if mode == "low_latency" and cfg.num_kv_heads % n == 0 else 1
    per_tok = 2 * cfg.num_kv_heads * cfg.head_dim * 2 / tp
    return per_tok * sum(
        min(context, cfg.sliding_window) if cfg.is_sliding(layer) else context for layer in range(cfg.num_layers)
    )


@dataclasses.dataclass(frozen=True)
class ComputeModel:
    """`seconds = c0 + weight bytes * s_per_byte + KV bytes * s_per_kv_byte + flops * s_per_flop` on the GPU it
    was fitted on."""

    c0: float
    s_per_byte: float
    s_per_kv_byte: float
    s_per_flop: float

    def parts(self, weights: float, kv: float, flops: float) -> tuple[float, float, float]:
        """(overhead, byte-bound, FLOP-bound) seconds."""
        return self.c0, weights * self.s_per_byte + kv * self.s_per_kv_byte, flops * self.s_per_flop

    def seconds(self, weights: float, kv: float, flops: float, target: Target | None = None) -> float:
        return scaled(self.parts(weights, kv, flops), target)


def scaled(parts: tuple[float, float, float], target: Target | None) -> float:
    """(overhead, byte-bound, FLOP-bound) seconds on the H200 -> seconds on `target`."""
    c0, b, f = parts
    if target is None:
        return c0 + b + f
    ref = TARGETS[MEASURED_ON]
    return c0 + b * ref.hbm_Bps / target.hbm_Bps + f * ref.bf16_flops / target.bf16_flops


def fit(points: list[tuple[str, float, float, float, float]]) -> dict[str, ComputeModel]:
    """Least relative squares over (model, weight bytes, KV bytes, flops, seconds), every coefficient >= 0: an
    overhead per model, the rates shared (both models run the same kernels on experts and attention heads of the
    same shapes; they differ in expert count, layers and batch)."""
    names = sorted({p[0] for p in points})
    X = np.array([[float(m == name) for name in names] + [w, kv, f] for m, w, kv, f, _ in points])
    y = np.array([p[4] for p in points])
    X = X / y[:, None]  # relative errors: every point counts alike, 2 ms or 80 ms
    scale = X.max(axis=0)
    coef = _nonnegative_lstsq(X / scale, np.ones(len(y))) / scale
    return {name: ComputeModel(coef[i], *coef[len(names) :]) for i, name in enumerate(names)}


def _engine_jobs(era: str):
    for model, files in CALIBRATIONS[era]["files"].items():
        for f in files:
            for job in json.loads((RESULTS / f).read_text())["jobs"]:
                if job["input_len"] in (1024, 8192):
                    yield model, job


def _calibration_points(era: str) -> list[tuple[str, int, int, float]]:
    """(model, batch, mean context, ms per decode step) on one H200."""
    if "files" not in CALIBRATIONS[era]:
        rows = json.loads((RESULTS / "decode_gemv16_h200.json").read_text())["rows"]
        return [(r["preset"], r["batch"], r["context"], r["tpot_ms"]) for r in rows if r["impl"] == "pallas"]
    return [
        (
            model,
            job["requests"],
            job["input_len"] + job["output_len"] // 2,
            job["decode_phase_s"] / (job["decode_phase_output_tokens"] / job["requests"]) * 1e3,
        )
        for model, job in _engine_jobs(era)
    ]


def prefill_rates(era: str = "today") -> dict[str, dict[int, float]]:
    """model -> prompt length -> prompt tokens per second of one H200 in the engine's prefill phase."""
    out: dict[str, dict[int, float]] = {}
    for model, job in _engine_jobs(era):
        if job["requests"] > 1:
            out.setdefault(model, {})[job["input_len"]] = job["requests"] * job["input_len"] / job["prefill_phase_s"]
    return out


def compute_models(era: str) -> dict[str, ComputeModel]:
    return fit(
        [
            (m, *rank_work(config_lib.preset(m), "low_latency", 1, b, c), ms / 1e3)
            for m, b, c, ms in _calibration_points(era)
        ]
    )


# ---- measured rank times (tools.measure_rank_shapes) -------------------------------------------------------------


class RankTimes:
    """Decode step seconds of one rank on one H200 from `tools.measure_rank_shapes`' JSON, for the full layer count:
    t4 + (layers - 4) / 2 x pair + layers x (MoE as dispatched - MoE as emulated), at each measured batch with
    pair = t4 - t2 at the first context, linear in batch between the measured ones, and linear in context through
    the batch measured at a second context.

    With `models` (the compute models, for presets): a layer pair is never faster than its bytes at the run's
    copy bandwidth (where the 2- and 4-layer steps both wait on the host, t4 - t2 is noise: the H200 run of
    2026-11-24 has t4 < t2 for 1 x 72), and past the largest measured batch the step grows by the model's
    increment (more KV, FLOPs, experts touched) instead of the line through the last two batches (the one-GPU
    120b step is cheaper at 256 than at 64: that line falls). The MoE correction is interpolated between the
    measured token counts and held at the last one beyond (flat from 64 to 256 tokens at 8 GPUs); a dispatch
    whose MoE was timed at fewer than two token counts has no correction and the rank falls back to the model."""

    def __init__(self, paths: Path | str | list, models: dict[str, ComputeModel] | None = None):
        """`paths`: one JSON or several (runs of `--devices` subsets); a config in a later file replaces one in an
        earlier file; the copy bandwidth is the first file's."""
        files = [json.loads(Path(p).read_text()) for p in (paths if isinstance(paths, list) else [paths])]
        self.data = files[0]
        self.configs = {(c["model"], c["mode"], c["n"]): c for f in files for c in f["configs"] if self._usable(c)}
        self.models = models
        self.copy_Bps = self.data.get("ceilings", {}).get("copy_Bps")

    @staticmethod
    def _usable(c: dict) -> bool:
        """Every batch timed with 2 layers at the first context has its 4-layer step."""
        rows = c.get("decode", [])
        if not rows:
            return False
        ctx0 = min(r["context"] for r in rows)
        at = {(r["layers"], r["batch"]) for r in rows if r["context"] == ctx0}
        return bool(at) and all((4, b) in at for lay, b in at if lay == 2)

    def _moe(self, c: dict) -> dict[str, list[tuple[int, float]]]:
        moe: dict[str, list] = {}
        for r in c["moe"]:
            if r["step"] == "decode":
                moe.setdefault(r["kind"], []).append((r["tokens"], r["ms_per_layer"] / 1e3))
        return {k: sorted(v) for k, v in moe.items()}

    def has(self, model: str, mode: str, n: int, dispatch: str = "-") -> bool:
        c = self.configs.get((model, "low_latency" if n == 1 else mode, n))
        if c is None:
            return False
        if n == 1:
            return True
        moe = self._moe(c)
        kind = "low_latency" if mode == "low_latency" else dispatch
        return all(len(moe.get(k, [])) >= 2 for k in ("emulated", kind))

    def _floor(self, model: str, mode: str, n: int, batch: int, ctx: int, ctx_from: int | None = None) -> float:
        """Seconds of a layer pair's HBM bytes at the run's copy bandwidth: its weights and KV at context `ctx`, or
        with `ctx_from` the KV it reads beyond that context; 0 where unknown."""
        if self.models is None or not self.copy_Bps or model not in self.models:
            return 0.0
        cfg = dataclasses.replace(config_lib.preset(model), num_layers=2)
        w, kv, _ = rank_work(cfg, mode, n, batch, ctx)
        if ctx_from is not None:
            return (kv - rank_work(cfg, mode, n, batch, ctx_from)[1]) / self.copy_Bps
        return (w - _unembed_bytes(cfg, mode, n) + kv) / self.copy_Bps

    def decode_s(self, model: str, mode: str, n: int, batch: int, context: int, dispatch: str) -> float:
        c = self.configs[(model, "low_latency" if n == 1 else mode, n)]
        L = c["layers_full"]
        d = {(r["layers"], r["batch"], r["context"]): r["ms"] / 1e3 for r in c["decode"]}
        ctx0 = min(r["context"] for r in c["decode"])
        batches = sorted(b for (lay, b, ctx) in d if lay == 2 and ctx == ctx0)
        pair_b = {b: max(d[(4, b, ctx0)] - d[(2, b, ctx0)], self._floor(model, mode, n, b, ctx0)) for b in batches}
        full_b = [(b, d[(4, b, ctx0)] + (L - 4) / 2 * pair_b[b]) for b in batches]
        last = batches[-1]
        if self.models is not None and batch > last and model in self.models:  # the model's increment
            cfg, m = config_lib.preset(model), self.models[model]
            step = full_b[-1][1] + (
                sum(m.parts(*rank_work(cfg, mode, n, batch, ctx0))) - sum(m.parts(*rank_work(cfg, mode, n, last, ctx0)))
            )
        else:
            step = _interp(full_b, batch)
        longer = [(b, ctx, t) for (lay, b, ctx), t in d.items() if lay == 2 and ctx != ctx0 and b in pair_b]
        if longer:  # the attention's growth with context, per sequence
            b1, ctx1, t1 = longer[0]
            grow = max(t1 - d[(2, b1, ctx0)], self._floor(model, mode, n, b1, ctx1, ctx0))
            step += L / 2 * (context - ctx0) / (ctx1 - ctx0) * grow * batch / b1
        delta = 0.0
        if n > 1 and self.has(model, mode, n, dispatch):
            moe = self._moe(c)
            kind = "low_latency" if mode == "low_latency" else dispatch
            delta = _interp_flat(moe[kind], batch) - _interp_flat(moe["emulated"], batch)
        return step + L * delta


def _unembed_bytes(cfg: config_lib.ModelConfig, mode: str, n: int) -> float:
    """The unembedding's bytes in `rank_work`'s weights (read once per step, not per layer)."""
    tpv = n if mode == "low_latency" and cfg.vocab_size % n == 0 else 1
    return 2 * cfg.vocab_size * cfg.hidden_size / tpv


def _interp_flat(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise linear through `points` (sorted by x), constant past both ends."""
    if x <= points[0][0] or len(points) == 1:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    return _interp(points, x)


def _interp(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise linear through `points` (sorted by x), extended linearly past both ends."""
    if len(points) == 1:
        return points[0][1] * x / points[0][0]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1 or (x1, y1) == points[-1]:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    raise AssertionError("unreachable")


# ---- communication -----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Comm:
    """Per step of one GPU, at the plan's tokens per GPU: collectives by kind and bytes sent, scaled per token."""

    counts: dict
    sent_per_token: float
    group: int

    @classmethod
    def from_plan(cls, plan: dict, step: str = "decode") -> Comm:
        s = plan["steps"][step]
        counts: dict[str, int] = {}
        group = 1
        for c in s["collectives"]:
            if c["conditional"] or c.get("emulation"):
                continue
            counts[c["kind"]] = counts.get(c["kind"], 0) + c["runs_full_model"]
            group = max(group, c["group"])
        return cls(counts, s["sent_bytes_per_token"] or 0.0, group)

    def seconds(self, tokens: float, s: Settings, target: Target) -> float:
        link = target.nvlink_Bps if self.group <= target.nvlink_domain else target.scaleout_Bps
        lat = 0.0
        for kind, count in self.counts.items():
            kind = _LATENCY_KIND.get(kind, kind)
            hops = (self.group - 2) * (2 if kind == "all-reduce" else 1)
            lat += count * (s.latency[kind] + hops * s.hop_latency)
        return lat + self.sent_per_token * tokens / (link * s.link_efficiency)


_LATENCY_KIND = {"reduce-scatter": "all-gather", "all-to-all": "ragged-all-to-all", "collective-permute": "all-gather"}


def plan_path(model: str, mode: str, dispatch: str, replicas: int, n: int) -> Path:
    short = model.removeprefix("gpt-oss-")
    m = "ll" if mode == "low_latency" else "mt"
    d = "a2a" if dispatch == "all_to_all" and mode == "max_throughput" else "ag"
    return PLANS / f"{short}-{m}-{d}-{replicas}x{n}.json"


def load_comm(model, mode, dispatch, replicas, n, step="decode") -> Comm | None:
    if n == 1:
        return Comm({}, 0.0, 1)
    p = plan_path(model, mode, dispatch, replicas, n)
    return Comm.from_plan(json.loads(p.read_text()), step) if p.exists() else None


def params_per_gpu(model, mode, replicas, n) -> float | None:
    p = plan_path(model, mode, "all_gather", replicas, n)
    if n == 1:
        return _single_gpu_params(model)
    return json.loads(p.read_text())["steps"]["decode"]["param_bytes_per_device"] if p.exists() else None


def _single_gpu_params(model: str) -> float:
    """Bytes of the whole model on one GPU (bf16 dense weights, MXFP4 experts), as plan_mesh counts them."""
    cfg = config_lib.preset(model)
    D, I, E, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.num_layers, cfg.vocab_size
    attn = cfg.head_dim * (cfg.num_heads + 2 * cfg.num_kv_heads) * D + cfg.num_heads * cfg.head_dim * D
    expert = 3 * I * D * 4.25 / 8 + 2 * (2 * I + D)
    return L * (2 * attn + 2 * E * D + E * expert) + 2 * 2 * V * D


# ---- the projection ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Settings:
    overlap: float = 0.0
    link_efficiency: float = 0.8
    # seconds per collective by kind on 2 GPUs (a priori: NCCL's small-message latency; `validate` fits them on the
    # 2-GPU runs), plus `hop_latency` per further GPU of the group (ring steps; twice for an all-reduce)
    latency: dict = dataclasses.field(
        default_factory=lambda: {"all-reduce": 20e-6, "all-gather": 15e-6, "ragged-all-to-all": 30e-6}
    )
    hop_latency: float = 1e-6
    max_batch: int = 640
    memory_fraction: float = 0.9


def step_seconds(compute: float, comm: float, overlap: float) -> float:
    """The explicit overlap assumption: 0 = the collectives wait for compute and vice versa, 1 = fully hidden."""
    return compute + comm - overlap * min(compute, comm)


def rank_compute(model, mode, n, batch, context, dispatch, target, models, rank_times=None) -> float:
    """Seconds of one GPU's own work in a decode step on `target` (None: the H200 measured on)."""
    parts = models[model].parts(*rank_work(config_lib.preset(model), mode, n, batch, context))
    if rank_times is not None and rank_times.has(model, mode, n, dispatch):  # measured: the MoE as dispatched included
        return rank_times.decode_s(model, mode, n, batch, context, dispatch) * scaled(parts, target) / sum(parts)
    return scaled(parts, target)


def project_job(
    model, mode, replicas, n, dispatch, target_name, isl, osl, batch, s: Settings, models, era="today", rank_times=None
) -> dict | None:
    target = TARGETS[target_name]
    comm = load_comm(model, mode, dispatch, replicas, n)
    pcomm = load_comm(model, mode, dispatch, replicas, n, "prefill")
    if comm is None:
        return None
    context = isl + osl // 2
    compute = rank_compute(model, mode, n, batch, context, dispatch, target, models, rank_times)
    c = comm.seconds(batch, s, target)
    step = step_seconds(compute, c, s.overlap)
    rate = _interp(sorted(prefill_rates(era)[model].items()), isl)  # tokens/s per GPU, one H200
    ref = TARGETS[MEASURED_ON]
    per_gpu = n if mode == "low_latency" else 1
    prefill_tok = 1 / (rate * per_gpu) * ref.bf16_flops / target.bf16_flops
    chunk = min(isl, 2048)
    prefill_comm = pcomm.seconds(chunk, s, target) / chunk if pcomm else 0.0
    prefill_s = batch * isl * step_seconds(prefill_tok, prefill_comm, s.overlap)
    return dict(
        model=model,
        mode=mode,
        mesh=f"{replicas}x{n}",
        gpus=replicas * n,
        dispatch=dispatch if mode == "max_throughput" and n > 1 else "-",
        target=target_name,
        job=f"{isl}/{osl}",
        batch_per_rank=batch,
        compute_from="measured rank"
        if rank_times is not None and rank_times.has(model, mode, n, dispatch)
        else "model",
        compute_ms=compute * 1e3,
        comm_ms=c * 1e3,
        step_ms=step * 1e3,
        tok_s_per_user=1 / step,
        tok_s_per_gpu=output_tok_s_per_gpu(batch, osl, prefill_s, step, per_gpu),
        comm_share=c / (compute + c) if compute + c else 0.0,
        prefill_share=prefill_s / (prefill_s + osl * step),
    )


def output_tok_s_per_gpu(batch: int, osl: int, prefill_s: float, step_s: float, gpus_per_rank: int) -> float:
    """A rank's `batch` sequences: their prompts' prefill, then `osl` decode steps; output tokens over that time,
    per GPU of the rank (prefill and decode do not overlap: chunked prefill takes the decode step's turn)."""
    return batch * osl / (prefill_s + osl * step_s) / gpus_per_rank


def max_batch(model, mode, replicas, n, target: Target, isl, osl, s: Settings) -> int:
    params = params_per_gpu(model, mode, replicas, n)
    kv = kv_bytes_per_sequence(config_lib.preset(model), mode, n, isl + osl)
    free = target.memory_bytes * s.memory_fraction - (params or 0) - 4e9  # 4 GB: activations, sampler, programs
    return max(0, min(s.max_batch, int(free // kv)))


def projection(s: Settings, rank_times=None, targets=("H200", "GB200"), models_names=None, jobs=JOBS) -> list[dict]:
    models = compute_models("today")
    rows = []
    for model in models_names or ("gpt-oss-120b", "gpt-oss-20b"):
        for mode, meshes in MESHES.items():
            for N, layouts in meshes.items():
                for replicas, n in layouts:
                    dispatches = ("all_gather", "all_to_all") if mode == "max_throughput" and n > 1 else ("-",)
                    for dispatch in dispatches:
                        for tname in targets:
                            for isl, osl in jobs:
                                if mode == "low_latency":
                                    batches = (1, 8)
                                else:
                                    batches = (max_batch(model, mode, replicas, n, TARGETS[tname], isl, osl, s),)
                                for b in batches:
                                    if b < 1:
                                        continue
                                    r = project_job(
                                        model,
                                        mode,
                                        replicas,
                                        n,
                                        dispatch,
                                        tname,
                                        isl,
                                        osl,
                                        b,
                                        s,
                                        models,
                                        rank_times=rank_times,
                                    )
                                    if r:
                                        rows.append(r)
    return rows


# ---- validation against the 2- and 4-H200 runs -------------------------------------------------------------------


def measured_runs() -> list[dict]:
    d = json.loads((RESULTS / "sharded_120b_h200x4_kernels_valid.json").read_text())
    rows = []
    for run in d["runs"].values():
        ctx = run["args"]["context"]
        for r in run["results"]:
            rows.append(dict(r, context=ctx, preset=run["args"]["preset"]))
    return rows


def validate(s: Settings, era: str = "2026-11-22", fit: bool = True, rank_times=None) -> dict:
    """Predicted against measured decode steps. With `fit`, the per-collective latencies (all-reduce; all-gather
    and reduce-scatter; ragged all-to-all) are fitted on the 2-GPU batch-1 rows (one per kind: there the step is
    mostly waiting), least squares >= 0; every other row is out of sample."""
    models = compute_models(era)
    target = TARGETS[MEASURED_ON]
    kinds = ("all-reduce", "all-gather", "ragged-all-to-all")
    rows = []
    for r in measured_runs():
        n, mode, dispatch, B = r["devices"], r["mode"], r["dispatch"], r["batch_per_rank"]
        comm = load_comm(r["preset"], mode, dispatch, 1, n)
        if comm is None:
            continue
        compute = rank_compute(r["preset"], mode, n, B, r["context"], dispatch, None, models, rank_times)
        measured = rank_times is not None and rank_times.has(r["preset"], mode, n, dispatch)
        counts = dict.fromkeys(kinds, 0.0)
        for kind, c in comm.counts.items():  # in units of the 2-GPU latency: the hops beyond are known
            kind = _LATENCY_KIND.get(kind, kind)
            counts[kind] += c
        no_latency = Comm(comm.counts, comm.sent_per_token, comm.group)
        rest = no_latency.seconds(B, dataclasses.replace(s, latency=dict.fromkeys(kinds, 0.0)), target)
        rows.append(dict(r, compute=compute, rest=rest, counts=counts, measured_rank=measured))
    latency = dict(s.latency)
    if fit:
        train = [r for r in rows if _training(r)]
        X = np.array([[r["counts"][k] for k in kinds] for r in train], float)
        y = np.array([r["step_ms"] / 1e3 - r["compute"] - r["rest"] for r in train])
        latency = dict(zip(kinds, map(float, _nonnegative_lstsq(X, y))))
    out = []
    for r in rows:
        comm_s = sum(r["counts"][k] * latency[k] for k in kinds) + r["rest"]
        pred = step_seconds(r["compute"], comm_s, s.overlap) * 1e3
        out.append(
            dict(
                gpus=r["devices"],
                mode=r["mode"],
                dispatch=r["dispatch"] if r["mode"] == "max_throughput" else "-",
                batch_per_rank=r["batch_per_rank"],
                measured_ms=r["step_ms"],
                projected_ms=pred,
                compute_ms=r["compute"] * 1e3,
                comm_ms=comm_s * 1e3,
                error_pct=(pred - r["step_ms"]) / r["step_ms"] * 100,
                fitted_on=fit and _training(r),
                measured_rank=r["measured_rank"],
            )
        )
    source = "measured rank shapes (today's code)" if rank_times else f"the {era} calibration"
    return dict(era=era, compute=source, latency_s=latency, hop_latency_s=s.hop_latency, rows=out)


def _training(row: dict) -> bool:
    return row["devices"] == 2 and row["batch_per_rank"] == 1


def _nonnegative_lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: the most negative one is fixed at 0 and the rest refitted."""
    keep = list(range(X.shape[1]))
    while keep:
        coef, *_ = np.linalg.lstsq(X[:, keep], y, rcond=None)
        if (coef >= 0).all():
            break
        keep.pop(int(np.argmin(coef)))
    out = np.zeros(X.shape[1])
    if keep:
        out[keep] = coef
    return out


# ---- output -----------------------------------------------------------------------------------------------------


def markdown_validation(v: dict) -> str:
    tag = v["compute"].startswith("measured")  # which rows had no measured rank
    lines = [
        "Per collective: "
        + ", ".join(f"{k} {t * 1e6:.1f} us" for k, t in v["latency_s"].items())
        + f" on 2 GPUs, +{v['hop_latency_s'] * 1e6:.1f} us per further GPU; compute: {v['compute']}",
        "",
        "| GPUs | mode | dispatch | batch/rank | measured | projected (compute + comm) | error |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in v["rows"]:
        lines.append(
            f"| {r['gpus']} | {r['mode']} | {r['dispatch']} | {r['batch_per_rank']} | {r['measured_ms']:.2f} ms | "
            f"{r['projected_ms']:.2f} ms ({r['compute_ms']:.2f} + {r['comm_ms']:.2f}) | {r['error_pct']:+.0f}%"
            f"{' (fit)' if r['fitted_on'] else ''}{' (model)' if tag and not r['measured_rank'] else ''} |"
        )
    return "\n".join(lines)


def markdown_projection(rows: list[dict]) -> str:
    lines = [
        "| model | mode | GPUs (mesh) | dispatch | target | job | batch/rank | step (compute + comm) | tok/s/user "
        "| **tok/s/GPU** | comm share | compute |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model'].removeprefix('gpt-oss-')} | {r['mode']} | {r['gpus']} ({r['mesh']}) | {r['dispatch']} | "
            f"{r['target']} | {r['job']} | {r['batch_per_rank']} | {r['step_ms']:.2f} ms ({r['compute_ms']:.2f} + "
            f"{r['comm_ms']:.2f}) | {r['tok_s_per_user']:,.0f} | **{r['tok_s_per_gpu']:,.0f}** | "
            f"{r['comm_share'] * 100:.0f}% | {r['compute_from']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--overlap", type=float, default=0.0, help="fraction of min(compute, comm) hidden (0..1)")
    ap.add_argument("--link-efficiency", type=float, default=0.8, help="achieved / data-sheet link bandwidth")
    ap.add_argument("--max-batch", type=int, default=640, help="max_throughput sequences per rank at most")
    ap.add_argument("--hop-latency-us", type=float, default=1.0, help="collective latency per GPU beyond 2")
    ap.add_argument("--targets", default="H200,GB200")
    ap.add_argument("--models", default="gpt-oss-120b,gpt-oss-20b")
    ap.add_argument("--jobs", default="1024/1024,8192/1024", help="ISL/OSL, comma-separated")
    ap.add_argument(
        "--rank-shapes",
        default=",".join(str(p) for p in RANK_SHAPES if p.exists()) or None,
        help="tools.measure_rank_shapes JSON(s), comma-separated: measured rank compute (default: "
        + ", ".join(p.name for p in RANK_SHAPES)
        + ")",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rank_times = RankTimes(args.rank_shapes.split(","), compute_models("today")) if args.rank_shapes else None
    if rank_times is not None and not rank_times.configs:
        print(f"{args.rank_shapes}: no rank config with a fixed part at every batch; compute from the model\n")
        rank_times = None
    s = Settings(
        overlap=0.0,
        link_efficiency=args.link_efficiency,
        max_batch=args.max_batch,
        hop_latency=args.hop_latency_us / 1e6,
    )
    v = validate(s)
    print("## Validation (no overlap, as the engine runs)\n")
    print(markdown_validation(v))
    measured = None
    if rank_times is not None:  # today's code per rank against the 2026-11-22 runs: not the same kernels
        measured = validate(s, rank_times=rank_times)
        usable = ", ".join(f"{m} {mode} n={n}" for m, mode, n in rank_times.configs)
        print(f"\n### The same with the measured rank compute of {args.rank_shapes} (configs: {usable})\n")
        print("Rows marked (model) have no measured rank (or no MoE correction) there: the model's compute.\n")
        print(markdown_validation(measured))
    s = dataclasses.replace(s, overlap=args.overlap, latency=dict(v["latency_s"]))
    jobs = tuple(tuple(int(x) for x in j.split("/")) for j in args.jobs.split(","))
    rows = projection(s, rank_times, tuple(args.targets.split(",")), tuple(args.models.split(",")), jobs)
    print(f"\n## Projection (overlap {args.overlap}, link efficiency {args.link_efficiency}, latencies as fitted)\n")
    print(markdown_projection(rows))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                dict(
                    settings=dataclasses.asdict(s),
                    targets={k: dataclasses.asdict(t) for k, t in TARGETS.items()},
                    calibrations={k: c["source"] for k, c in CALIBRATIONS.items()},
                    prefill_rates=prefill_rates(),
                    compute_models={
                        e: {m: dataclasses.asdict(c) for m, c in compute_models(e).items()} for e in CALIBRATIONS
                    },
                    rank_shapes=[str(Path(p).resolve().relative_to(REPO)) for p in args.rank_shapes.split(",")]
                    if args.rank_shapes
                    else None,
                    validation=v,
                    validation_measured_ranks=measured,
                    projection=rows,
                ),
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
