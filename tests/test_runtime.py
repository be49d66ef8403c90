"""Start-up: the persistent compilation cache (where it lives, that a warm restart compiles nothing, that a failing
cache never fails a start) and warm-up progress."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gptoss_jax import Engine, runtime

REPO = Path(__file__).resolve().parent.parent
SMALL = dict(
    max_num_seqs=4,
    max_num_batched_tokens=64,
    prefill_chunk_size=32,
    max_prefill_seqs=2,
    decode_steps_per_call=2,
    min_prefill_bucket=16,
    min_context_bucket=64,
    kv_cache_tokens=512,
    max_model_len=128,
)
# 4 programs, one of each kind (each compiled in every start below, ~5 s on 2 CPU cores): a decode bucket's program
# for greedy calls and the one for the others, prefill of 16 and of 32 tokens
FEW = dict(SMALL, max_num_seqs=1, max_prefill_seqs=1, min_context_bucket=128)


def test_compile_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv("GPTOSS_JAX_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("GPTOSS_JAX_HOME", str(tmp_path / "home"))
    if runtime.jax.config.jax_compilation_cache_dir is not None:
        pytest.skip("JAX_COMPILATION_CACHE_DIR is set: JAX's own folder then comes before the default")
    assert runtime.compile_cache_dir() == tmp_path / "home" / "compile-cache"
    assert runtime.compile_cache_dir(tmp_path / "x") == tmp_path / "x"
    for off in (False, "off", "none", "0", ""):
        assert runtime.compile_cache_dir(off) is None
    monkeypatch.setenv("GPTOSS_JAX_COMPILE_CACHE", str(tmp_path / "env"))
    assert runtime.compile_cache_dir() == tmp_path / "env"
    assert runtime.compile_cache_dir(tmp_path / "arg") == tmp_path / "arg"  # an explicit folder wins
    monkeypatch.setenv("GPTOSS_JAX_COMPILE_CACHE", "off")
    assert runtime.compile_cache_dir() is None
    monkeypatch.delenv("GPTOSS_JAX_HOME")
    monkeypatch.delenv("GPTOSS_JAX_COMPILE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert runtime.compile_cache_dir() == tmp_path / "xdg" / "gptoss_jax" / "compile-cache"


_START = textwrap.dedent("""
    import json, sys, time
    from jax import monitoring
    from jax._src import dispatch
    compiled, hits = [], []  # XLA's compile event also fires for a program loaded from the persistent cache
    monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: compiled.append(kw.get("fun_name")) if event == dispatch.BACKEND_COMPILE_EVENT
        else None)
    monitoring.register_event_listener(
        lambda event, **kw: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None)
    from gptoss_jax import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(sys.argv[1], dtype="float32", compile_cache_dir=sys.argv[2], progress=False, warmup=True,
              **json.loads(sys.argv[3]))
    out = llm.generate(prompt_token_ids=[[1, 2, 3, 4, 5]], sampling_params=SamplingParams(temperature=0, max_tokens=5),
                       use_tqdm=False)
    print(json.dumps(dict(compiled=compiled, misses=len(compiled) - len(hits), tokens=out[0].outputs[0].token_ids,
                          seconds=time.perf_counter() - t0)))
""")


def _start(checkpoint, cache, **env) -> dict:
    """A fresh process that builds an `LLM` (warm-up on) with `cache` and generates: the XLA compilations it made."""
    out = subprocess.run(
        [sys.executable, "-c", _START, str(checkpoint), str(cache), json.dumps(FEW)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # three processes compile the small model's every bucket
def test_warm_restart_compiles_nothing(small_checkpoint, tmp_path):
    """The first start compiles every program and stores it; a restart loads them all and compiles nothing (XLA's
    compile events and cache hits counted), with the same output. Two processes started at once on an empty folder
    both start."""
    cache = tmp_path / "cache"
    cold = _start(small_checkpoint, cache)
    assert {"jit(decode)", "jit(prefill)"} <= set(cold["compiled"]), cold["compiled"]
    warm = _start(small_checkpoint, cache)
    assert cold["misses"] == len(cold["compiled"])
    # nothing compiled again; the engine's steps not even traced (the program store loads them), the rest hits
    assert warm["misses"] == 0 and not {"jit(decode)", "jit(prefill)"} & set(warm["compiled"])
    assert warm["tokens"] == cold["tokens"]
    assert oct(cache.stat().st_mode & 0o777) == oct(0o700)  # a compilation cache is trusted code: private
    both = tmp_path / "both"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _START, str(small_checkpoint), str(both), json.dumps(FEW)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [r[1][-2000:] for r in results]
    assert [json.loads(r[0].strip().splitlines()[-1])["tokens"] for r in results] == [cold["tokens"]] * 2


def test_a_failing_cache_never_fails_a_start(small_checkpoint, tmp_path, caplog):
    """A folder that cannot be made turns the cache off with a warning; writes that fail (a full disk) warn."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with caplog.at_level("WARNING", logger="gptoss_jax.runtime"):
        assert runtime.prepare(blocker / "cache") is None
    assert "compilation cache off" in caplog.text
    out = _start(small_checkpoint, tmp_path / "full", PYTHONPATH=str(tmp_path / "site"), **_full_disk(tmp_path))
    assert out["tokens"] and out["misses"] > 0 and not any((tmp_path / "full").glob("*-cache"))


def _full_disk(tmp_path) -> dict:
    """A `sitecustomize` that makes every write of JAX's cache fail as on a full disk."""
    site = tmp_path / "site"
    site.mkdir()
    code = """
import errno
from jax._src import lru_cache
def put(self, key, value):
    raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
lru_cache.LRUCache.put = put
"""
    (site / "sitecustomize.py").write_text(code)
    return {}


def test_warmup_reports_progress(small_checkpoint, caplog):
    """Warm-up tells its listener and the log program by program, each program compiled once."""
    seen = []
    with caplog.at_level("INFO", logger="gptoss_jax.engine"):
        eng = Engine(
            small_checkpoint,
            dtype="float32",
            progress=False,
            warmup=True,
            compile_cache_dir=False,
            on_progress=lambda *a: seen.append(a),
            **FEW,
        )
    n = len(eng.runner.buckets())
    eng.close()
    assert n == 4  # 2 prefill programs; 1 decode bucket, with a program for greedy calls and one for the others
    stages = [s for s, *_ in seen]
    assert stages[:2] == ["loading weights", "loading weights"] and seen[1][1:3] == (1, 1)
    compiling = [(d, t) for s, d, t, _ in seen if s == "compiling"]
    assert sorted(compiling) == [(i, n) for i in range(1, n + 1)]
    assert [d for s, d, t, _ in seen if s == "tracing"] == list(range(1, n + 1))
    assert [d for s, d, t, _ in seen if s == "first run"] == []  # on a GPU only
    assert f"warm-up: compiled {n}/{n} programs (" in caplog.text


@pytest.mark.parametrize("impl", ["pallas", "reference"])
def test_the_kernels_steps_take_one_table_width(small_checkpoint, impl):
    """Prefill and decode with the kernels take the widest table always (their cost does not grow with the table):
    one program per row count (and prefill tokens); the reference attention (which gathers the whole table) keeps
    the widths."""
    eng = Engine(small_checkpoint, dtype="float32", progress=False, impl=impl, compile_cache_dir=False, **SMALL)
    buckets, ec = eng.runner.buckets(), eng.config
    eng.close()
    widths = ec.context_buckets(eng.max_model_len)
    assert len(widths) == 2
    decode_widths = {k[2] for k in buckets if k[0] == "decode"}
    prefill_widths = {k[3] for k in buckets if k[0] == "prefill"}
    assert decode_widths == prefill_widths == ({widths[-1]} if impl == "pallas" else set(widths))
    # each decode bucket twice: calls of greedy rows alone and the others (`StepConfig.plain`)
    assert len([k for k in buckets if k[0] == "decode"]) == 2 * len(ec.decode_buckets()) * len(decode_widths)
    rows_tokens = len(ec.prefill_row_buckets()) * len(ec.prefill_token_buckets())
    assert len([k for k in buckets if k[0] == "prefill"]) == rows_tokens * len(prefill_widths)


@pytest.mark.slow  # two worker processes start and import JAX
@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_workers_lower_the_programs_and_serving_compiles_nothing(small_checkpoint, impl):
    """Warm-up's programs lowered in worker processes (`compile_workers`) are the programs the engine's own lowering
    makes: the same tokens, and nothing traced or compiled while serving. With the kernels (interpreted here) the
    workers lower them for the device the config names, not for their own backend."""
    from gptoss_jax import SamplingParams, steps

    kw = dict(dtype="float32", progress=False, warmup=True, compile_cache_dir=False, impl=impl, **FEW)
    prompts = [[3, 14, 15, 92, 65, 35], [89, 79, 32]]
    sp = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[])
    outputs = []
    for workers in (0, 2):
        eng = Engine(small_checkpoint, compile_workers=workers, **kw)
        assert eng.runner.lowered_in_workers == (len(eng.runner.buckets()) if workers else 0)
        before = sum(steps.TRACES.values())
        with steps.compilations() as seen:
            for i, p in enumerate(prompts):
                eng.add_request(str(i), p, sp)
            out = {}
            while eng.has_unfinished_requests():
                for o in eng.step():
                    out.setdefault(o.request_id, []).extend(o.new_token_ids)
            outputs.append(out)
        eng.close()
        assert seen == [] and sum(steps.TRACES.values()) == before
    assert outputs[0] == outputs[1]


@pytest.mark.slow  # a fresh process builds an engine with two workers
def test_lowering_workers_do_not_run_the_users_script_again(small_checkpoint, tmp_path):
    """Workers are fresh interpreters, not `multiprocessing` children (which import the main script again): a script
    without an `if __name__ == "__main__"` guard runs once, and its engine's programs come from the workers."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(f"""
            print("script ran", flush=True)
            from gptoss_jax import Engine
            kw = dict(dtype="float32", progress=False, warmup=True, compile_cache_dir=False, compile_workers=2)
            eng = Engine({str(small_checkpoint)!r}, **kw, **{FEW!r})
            print("lowered in workers", eng.runner.lowered_in_workers, "of", len(eng.runner.buckets()), flush=True)
        """)
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("script ran") == 1
    assert "lowered in workers 4 of 4" in out.stdout  # FEW: 2 prefill programs, 2 decode
