import dataclasses
import json
import statistics
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from gptoss_jax import checkpoint
from pallas_kernels import KernelConfig

REPO = Path(__file__).resolve().parent.parent
TOOLS = sorted(p.stem for p in (REPO / "tools").glob("*.py") if p.stem != "__init__")
OPTIONAL = ("torch", "transformers")  # only on the machines whose tools need them (peer_transformers, make_golden)


def _python(*args, check=True):
    res = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert not check or res.returncode == 0, res.stderr
    return res


def _run(tool, *args):
    """`python -m tools.TOOL ARGS` from the repository root -> its stdout."""
    return _python("-m", f"tools.{tool}", *args).stdout


def test_make_checkpoint_then_convert_then_restore(tmp_path):
    cfg = REPO / "tests" / "tiny_config.json"
    _run("make_checkpoint", "--config", cfg, "--out", tmp_path / "ck", "--layout", "original")
    assert (tmp_path / "ck" / "original" / "model.safetensors").exists()
    out = _run("convert_checkpoint", "--model", tmp_path / "ck", "--cache-dir", tmp_path / "cache")
    assert "ready" in out and len(list((tmp_path / "cache").iterdir())) == 1
    _, direct = checkpoint.load_params(tmp_path / "ck", jnp.bfloat16, progress=False)
    _, restored = checkpoint.load(tmp_path / "ck", jnp.bfloat16, cache_dir=tmp_path / "cache", progress=False)
    assert (direct.layers.experts.down_blocks == restored.layers.experts.down_blocks).all()
    assert (direct.unembed == restored.unembed).all()


# The smoke runs' jobs sample (bench_throughput) or take one token (bench_prefix_cache) and never run the greedy
# calls' programs, nor prefill calls of more rows than a step's tokens fill: their engines leave those out of warm-up,
# as a user's `--set` may (the programs each compiles are ~5 s on 2 CPU cores).
FEWER_PROGRAMS = ("--set", "greedy_program_rows=0", "--set", "max_prefill_seqs=4")


@pytest.mark.slow  # a tool run: engines warmed up for two jobs
def test_bench_throughput_smoke(tmp_path):
    """The throughput benchmark's whole path (random weights, jobs, latency run, JSON) on a tiny model; a setting of
    the latency job's own names it."""
    latency = ("--latency-set", "max_num_seqs=1", "--latency-set", "greedy_program_rows=0")
    _run("bench_throughput", "--smoke", *FEWER_PROGRAMS, *latency, "--out", tmp_path / "tp.json")
    result = json.loads((tmp_path / "tp.json").read_text())
    names = [j["job"] for j in result["jobs"]]
    assert names == ["throughput 24/16", "latency max_num_seqs=1 greedy_program_rows=0"]
    for job in result["jobs"]:
        assert job["output_tokens"] == job["requests"] * job["output_len"] and job["output_tok_s"] > 0
        assert job["host_s"].get("compiles", 0) == 0, job["host_s"]  # warm-up compiled every program it ran


@pytest.mark.slow  # a tool run: an engine warmed up
def test_bench_prefix_cache_smoke(tmp_path):
    """The prefix-cache benchmark: each shared-prefix job follows a job without hits over the prompts it shares, and
    its hits spare the prompt tokens before the sliding layers' window (the smoke model: 1 sliding layer of window 8,
    16-token pages: 40 shared tokens hit 32, 25 of them not computed)."""
    _run(
        "bench_prefix_cache",
        "--smoke",
        *FEWER_PROGRAMS,
        "--set",
        "decode_batch_buckets=[4]",
        "--out",
        tmp_path / "pc.json",
    )
    result = json.loads((tmp_path / "pc.json").read_text())
    got = [(j["job"], j["cached_prompt_tokens"], j["seconds"] > 0) for j in result["jobs"]]
    assert got == [("no hit", 0, True), ("40 shared", 4 * 25, True)]


@pytest.mark.slow  # a tool run: three engines warmed up
def test_bench_speculative_smoke(tmp_path):
    """The speculative benchmark's whole path (verify steps, drafters, end to end with the oracle) on a tiny model."""
    # one request a job, two jobs an engine (each on its own prompt, the row their median)
    _run("bench_speculative", "--smoke", "--set", "max_num_seqs=1", "--repeats", "2", "--out", tmp_path / "spec.json")
    result = json.loads((tmp_path / "spec.json").read_text())
    assert [(r["k"], r["ms"] > 0) for r in result["verify"]] == [(0, True), (2, True)]
    assert [r["method"] for r in result["drafter"]] == ["ngram", "oracle"]
    plain, spec = result["e2e"]
    assert plain["k"] == 0 and spec["k"] == 2 and spec["acceptance_length_target"] == 2.5
    assert spec["identical_to_plain"] and 1.5 < spec["acceptance_length"] <= 2.5
    assert spec["output_tokens"] == plain["output_tokens"] == 12
    assert [[r["output_tokens"] for r in row["runs"]] for row in (plain, spec)] == [[12, 12], [12, 12]]
    assert spec["output_tok_s"] == pytest.approx(statistics.median(r["output_tok_s"] for r in spec["runs"]))


@pytest.mark.slow  # a tool run on 8 simulated devices
def test_bench_sharded_smoke(tmp_path):
    """The sharded benchmark on 8 simulated devices: random weights in the kernels' layout, both dispatches."""
    _run(
        "bench_sharded",
        "--smoke",
        "--mode",
        "max_throughput",
        "--dispatch",
        "both",
        "--batch",
        "2",
        "--layers",
        "2",
        "--context",
        "64",
        "--json",
        tmp_path / "s.json",
    )
    rows = json.loads((tmp_path / "s.json").read_text())["results"]
    assert [(r["mode"], r["dispatch"], r["impl"]) for r in rows] == [
        ("max_throughput", "all_gather", "pallas"),
        ("max_throughput", "all_to_all", "pallas"),
    ]
    for r in rows:
        assert r["global_batch"] == 16 and r["devices"] == 8 and r["step_ms"] > 0
        assert abs(r["tok_s"] - 16e3 / r["step_ms"]) < 1e-6 * r["tok_s"]
        assert abs(r["tok_s_per_device"] * 8 - r["tok_s"]) < 1e-6 * r["tok_s"]


def test_inspect_kernels_lowers_the_decode_step_for_cuda_on_the_cpu():
    """`tools.inspect_kernels` finds every Pallas-Triton kernel of the batch-1 decode step, with its grid and
    launch settings, and restores what it patched (its compile half needs the triton wheel and is not run here)."""
    import jax

    from tools import inspect_kernels

    kernels = inspect_kernels.step_kernels(str(REPO / "tests" / "tiny_config.json"), 1, 64)
    by_name = {}
    for k in kernels:
        by_name.setdefault(k["name"], []).append(k)
    assert set(by_name) == {
        "decode_linear_x3",
        "decode_linear",
        "paged_decode_attention_new_token",
        "moe_route",
        "mxfp4_gate_up_swiglu_gemv16",
        "mxfp4_down_gemv16",
        "moe_residual_norm",
    }, set(by_name)
    [gate_up] = by_name["mxfp4_gate_up_swiglu_gemv16"]
    assert gate_up["grid"][0] == 2 and gate_up["num_warps"] == 4 and "tt.load" in gate_up["ir"]  # one row per pair
    assert len(by_name["paged_decode_attention_new_token"]) == 2  # sliding and full layers differ
    assert jax.default_backend() == "cpu"


def test_inspect_kernels_lowers_a_prefill_call_and_counts_loop_instructions():
    """`--prefill`: the prefill call's kernels (the flash kernel for chunks after cached tokens, sliding and full
    layers); the SASS loop counter counts each loop from its backward branch's target, not forward branches."""
    from tools import inspect_kernels

    kernels = inspect_kernels.step_kernels(str(REPO / "tests" / "tiny_config.json"), 2, 48, prefill_tokens=32)
    flash = [k for k in kernels if k["name"] == "paged_flash_attention"]
    assert len(flash) == 2 and all(k["grid"][0] == 2 for k in flash), [k["grid"] for k in flash]
    sass = "\n".join(
        f"        /*{16 * i:04x}*/                   {op} ;   /* 0x0 */"
        for i, op in enumerate(
            ["MOV R1, c[0x0][0x28]", "@P0 BRA 0x60", "FADD R2, R2, R3", "MUFU.EX2 R4, R2", "@!P1 BRA 0x20", "EXIT"]
        )
    )
    assert inspect_kernels.loop_instructions(sass) == [3]  # FADD, MUFU and the branch back to 0x20


def test_speculative_step_lowers_for_cuda_on_the_cpu():
    """The verify step (k + 1 tokens per row over the paged cache) through the GPU kernels, at the 20b shapes: the
    new-token attention kernel, one program row per token, the MoE and projection kernels of a 4-token batch."""
    from gptoss_jax import speculative
    from tools import common, inspect_kernels

    cfg = common.model_config("gpt-oss-20b")
    spec = speculative.SpeculativeConfig("oracle", 3)
    drafter = speculative.make_drafter(spec, cfg.vocab_size, 2048)
    kernels = inspect_kernels.BASE.for_device(inspect_kernels.H200)
    shapes = common.param_shapes(cfg, "pallas")
    step = common.speculative_step(
        shapes, cfg, 1, 1024, kernels, drafter, num_steps=2, draft_params=drafter.params(spec)
    )
    found = []
    with inspect_kernels.lowering_for_hopper(), inspect_kernels.capture_triton_modules(found):
        step.lower(lowering_platforms=("cuda",))
    names = {k["name"] for k in found}
    assert {"paged_decode_attention_new_token", "moe_route", "mxfp4_gate_up_swiglu_gemv16"} <= names
    assert not names & {"paged_flash_attention", "paged_decode_attention"}
    attention = [k for k in found if k["name"] == "paged_decode_attention_new_token"]
    assert {k["grid"][0] for k in attention} == {4}, [k["grid"] for k in attention]


def test_resident_programs_follow_the_sm_limits():
    """Registers (per warp, in units of 256), warps, programs and shared memory each bound the programs an SM holds:
    the figures session 14's ncu report gave for the gate/up GEMV (64 registers, 128 threads: 8 programs)."""
    from tools.inspect_kernels import resident_programs

    assert resident_programs(64, 4, 1024) == 8
    assert resident_programs(65, 4, 1024) == 7  # 72 registers allocated
    assert resident_programs(52, 4, 73728) == 3  # shared memory: 3 x (72 + 1) KB of 228 KB
    assert resident_programs(16, 1, 0) == 32  # the programs-per-SM limit
    assert resident_programs(32, 16, 0) == 4  # the warps limit


# In a fresh interpreter: every tool imports as `tools.NAME` (a missing optional package aside) without touching a
# device (each main() applies `runtime.prepare()` first), and every script's `--help` works.
_IMPORT_AND_HELP = f"""
import contextlib, importlib, io, sys
from jax._src import xla_bridge
for name in sys.argv[1:]:
    try:
        module = importlib.import_module("tools." + name)
    except ModuleNotFoundError as e:
        if e.name.split(".")[0] in {OPTIONAL!r}:
            continue
        raise
    assert not xla_bridge.backends_are_initialized(), "importing tools." + name + " touched a device"
    if not hasattr(module, "main"):  # shared code, no script
        continue
    sys.argv = ["tools." + name, "--help"]
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
        module.main()
    assert out.getvalue().startswith("usage:"), name
"""


def test_tools_are_a_package_without_path_hacks():
    """Scripts run as `python -m tools.NAME` from the repository root: none edits `sys.path` to find the packages
    or each other."""
    for name in TOOLS:
        assert "sys.path" not in (REPO / "tools" / f"{name}.py").read_text(), f"tools/{name}.py edits sys.path"
    _python("-c", _IMPORT_AND_HELP, *TOOLS)


def test_variants_are_kernel_configs():
    """`--variant NAME:field=value,...` replaces `KernelConfig` fields (values as Python literals, or as a config
    file spells true / false / null); a field KernelConfig lacks, or a value it rejects, is an error naming it."""
    from tools.common import parse_variant

    base = KernelConfig(impl="pallas")
    name, kernels = parse_variant("unfused:moe_route_max_tokens=0, mosaic=false,linear_stages=2", base)
    assert name == "unfused"
    assert kernels == dataclasses.replace(base, moe_route_max_tokens=0, mosaic=False, linear_stages=2)
    assert parse_variant("tree", base) == ("tree", base)
    assert parse_variant("ref:impl=reference,mosaic=None")[1] == KernelConfig(impl="reference", mosaic=None)
    assert parse_variant("q:impl='pallas',mosaic=True")[1] == KernelConfig(impl="pallas", mosaic=True)
    for spec, error in [
        ("x:linear_stagez=2", "KernelConfig has no field 'linear_stagez'"),
        ("x:device=1", "no field 'device'"),  # detected, never configured
        ("x:linear_stages=0", "must be an integer >= 1"),  # KernelConfig's own check
        ("x:linear_stages=2+", "not a Python literal"),
        ("x:linear_stages", "is not field=value"),
        (":linear_stages=2", "expected NAME:"),
    ]:
        with pytest.raises(ValueError, match=error):
            parse_variant(spec)
    res = _python("-m", "tools.ab_decode", "--variant", "x:no_such_field=1", check=False)
    assert res.returncode == 2 and "no field 'no_such_field'" in res.stderr, res.stderr


def test_bench_throughput_jobs_carry_their_own_settings():
    """A job's own settings (after ':') apply to that job only; a malformed entry names itself."""
    from tools.bench_throughput import parse_jobs

    jobs = parse_jobs("1024/1024,8192/1024x512:kv_cache_dtype=fp8;max_num_seqs=512", 256, "max_throughput")
    assert jobs == [
        ("throughput 1024/1024", "max_throughput", 256, 1024, 1024, {}),
        (
            "throughput 8192/1024 kv_cache_dtype=fp8;max_num_seqs=512",
            "max_throughput",
            512,
            8192,
            1024,
            {"kv_cache_dtype": "fp8", "max_num_seqs": 512},
        ),
    ]
    for bad in ("8192x64", "8192/1024x64:max_num_seqs"):
        with pytest.raises(ValueError, match="max_num_seqs|INPUT/OUTPUT"):
            parse_jobs(bad, 256, "max_throughput")


def test_simulate_scheduler_counts_calls_padding_and_recomputation(tmp_path, capsys):
    """The scheduler simulation of an offline job: whole 4-chunk prompts in calls of 4 x 2,048 with room; a pool too
    small for the running sequences' growth preempts and recomputes prompt tokens, which the summary counts."""
    from tools import simulate_scheduler

    job = "8192/64x24:max_num_seqs=8;max_num_batched_tokens=8192;max_prefill_seqs=4"
    simulate_scheduler.main(["--jobs", job, "--full-pages", "100000", "--out", str(tmp_path / "roomy.json")])
    roomy = json.loads((tmp_path / "roomy.json").read_text())[0]
    assert roomy["prefill_shapes"] == {"4x2048": 24} and roomy["padding"] == 1.0
    assert roomy["recomputed"] == roomy["preemptions"] == 0 and roomy["prefill_tokens_computed"] == 24 * 8192
    simulate_scheduler.main(["--jobs", job, "--full-pages", "3600", "--out", str(tmp_path / "tight.json")])
    tight = json.loads((tmp_path / "tight.json").read_text())[0]
    assert tight["preemptions"] > 0 and tight["recomputed"] > 0
    assert tight["prefill_tokens_computed"] == 24 * 8192 + tight["recomputed"]
    assert '"job": "throughput 8192/64 max_num_seqs=8' in capsys.readouterr().out


def test_trace_request_splits_the_first_token_time():
    """Kernels of one module in a row are one program run (busy: the union of their intervals); the first token's
    time splits into host time before the first kernel, the programs before it, and the rest."""
    from tools.trace_request import program_runs, request_timeline

    host = [
        {"name": "add_request", "start": 1000.0, "end": 1100.0},
        {"name": "step 1", "start": 1100.0, "end": 2500.0},
        {"name": "step 2", "start": 2500.0, "end": 30000.0},
        {"name": "step 3", "start": 30000.0, "end": 32000.0},
    ]
    kern = [
        {"name": "a", "start": 500.0, "end": 900.0, "module": "jit_decode"},  # before the request: not its own
        {"name": "b", "start": 2000.0, "end": 12000.0, "module": "jit_prefill"},
        {"name": "c", "start": 11000.0, "end": 26000.0, "module": "jit_prefill"},  # overlaps b
        {"name": "d", "start": 26050.0, "end": 28000.0, "module": "jit_decode"},  # launched before the token came
        {"name": "e", "start": 28100.0, "end": 30900.0, "module": "jit_decode"},  # the same call
        {"name": "f", "start": 31200.0, "end": 31750.0, "module": "jit_decode"},  # the next call, after a gap
    ]
    runs = program_runs(kern[1:3])
    assert [(r["module"], r["kernels"], r["busy"]) for r in runs] == [("jit_prefill", 2, 24000.0)]
    other = [
        {"name": "schedule", "start": 1150.0, "end": 1400.0},
        {"name": "device_put", "start": 1400.0, "end": 1500.0},
        {"name": "device_put", "start": 1500.0, "end": 1700.0},
        {"name": "dispatch", "start": 1900.0, "end": 2100.0},  # counted up to the first kernel
        {"name": "collect", "start": 29000.0, "end": 29500.0},  # after it: not counted
    ]
    t = request_timeline(host, kern, {"step 2": 1}, "step 2", other)
    assert t["host_before_first_kernel"] == [
        {"name": "device_put", "ms": 0.3, "count": 2},
        {"name": "schedule", "ms": 0.25, "count": 1},
        {"name": "dispatch", "ms": 0.1, "count": 1},
    ]
    assert [(p["module"], p["kernels"], p["busy_ms"]) for p in t["programs"]] == [
        ("jit_prefill", 2, 24.0),
        ("jit_decode", 2, 4.75),
        ("jit_decode", 1, 0.55),
    ]
    assert t["first_token_ms"] == 29.0
    assert t["first_token_split_ms"] == {  # the decode call still ran when the token came: not waited for
        "host_before_first_kernel": 1.0,
        "programs_busy": 24.0,
        "programs_span": 24.0,
        "after_last_kernel": 4.0,
    }
