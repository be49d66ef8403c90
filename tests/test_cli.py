"""`serve` and `generate` command lines: vLLM's flag names over the engine profile, `--help`, one-line start-up
errors before the server listens, and the server-side flags (CORS, root path, request log, TLS) on a live server."""

import os
import subprocess
import sys
import time

import httpx
import pytest

from gptoss_jax import generate, serve
from gptoss_jax.config import ConfigError

pytest.importorskip("openai_harmony")


def test_vllm_flags_override_the_profile(small_checkpoint):
    from gptoss_jax import cli

    args = serve.parse_args(
        [
            "--model",
            str(small_checkpoint),
            "--config",
            "max_throughput",
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "4096",
            "--gpu-memory-utilization",
            "0.5",
            "-tp",
            "2",
            "--data-parallel-size",
            "3",
            "--no-enable-prefix-caching",
        ]
    )
    path, ec = cli.resolve(args)
    assert path == small_checkpoint
    assert (ec.max_model_len, ec.max_num_seqs, ec.max_num_batched_tokens, ec.gpu_memory_utilization) == (
        512,
        8,
        4096,
        0.5,
    )
    assert (ec.model_parallel, ec.replicas, ec.enable_prefix_caching) == (2, 3, False)
    assert ec.decode_steps_per_call == 2 and ec.parallel_mode == "max_throughput"  # the rest: the profile's
    plain = cli.resolve(serve.parse_args(["--model", str(small_checkpoint), "--engine-config", "low_latency"]))[1]
    assert plain.max_num_seqs == 16 and plain.enable_prefix_caching
    gen = generate.parse_args(
        ["--model", str(small_checkpoint), "--prompt", "x", "--config", "low_latency", "-tp", "2"]
    )
    assert cli.resolve(gen)[1].model_parallel == 2
    with pytest.raises(ConfigError, match="gpu_memory_utilization=1.5"):
        cli.resolve(serve.parse_args(["--model", str(small_checkpoint), "--gpu-memory-utilization", "1.5"]))
    model = ["--model", str(small_checkpoint)]
    assert cli.resolve(serve.parse_args([*model, "--compile-workers", "3"]))[1].compile_workers == 3
    assert cli.resolve(serve.parse_args(model))[1].compile_workers is None  # the device decides
    with pytest.raises(ConfigError, match="compile_workers=-1"):
        cli.resolve(serve.parse_args([*model, "--compile-workers", "-1"]))


def test_help_names_the_program_and_lists_defaults(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["/usr/bin/gptoss-serve"])
    monkeypatch.setenv("GPTOSS_JAX_API_KEY", "sk-secret")
    with pytest.raises(SystemExit):
        serve.parse_args(["--help"])
    text = capsys.readouterr().out
    assert text.startswith("usage: gptoss-serve ") and "(default: 8000)" in text and "(default: 127.0.0.1)" in text
    assert "sk-secret" not in text  # the key's default is named, never printed
    for flag in ("--max-model-len", "--gpu-memory-utilization", "--tensor-parallel-size", "--allowed-origins"):
        assert flag in text
    monkeypatch.setattr(sys, "argv", ["generate.py"])
    with pytest.raises(SystemExit):
        generate.parse_args(["--help"])
    text = capsys.readouterr().out
    assert text.startswith("usage: python -m gptoss_jax.generate ")
    assert "--temperature TEMPERATURE\n                        0 is greedy (default: 0.0)" in text
    assert "(default: 64)" in text and "--engine-config" in text


def test_origins_as_json_or_commas():
    assert serve.parse_args(["--allowed-origins", '["http://a", "http://b"]']).allowed_origins == [
        "http://a",
        "http://b",
    ]
    assert serve.parse_args(["--allowed-origins", "http://a, http://b"]).allowed_origins == ["http://a", "http://b"]
    with pytest.raises(SystemExit):
        serve.parse_args(["--ssl-keyfile", "k.pem"])  # without --ssl-certfile


def test_max_stored_responses_flag(capsys):
    assert serve.parse_args([]).max_stored_responses == 1000
    assert serve.parse_args(["--max-stored-responses", "0"]).max_stored_responses == 0
    with pytest.raises(SystemExit):
        serve.parse_args(["--max-stored-responses", "-1"])
    assert "--max-stored-responses must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "/no/such/folder"], "error: /no/such/folder: checkpoint folder not found"),
        (["--config", "{bad}"], "unknown engine setting 'max_num_seq' (did you mean 'max_num_seqs'?"),
        (["--tokenizer", "/no/vocab.tiktoken"], "error: tokenizer rank file /no/vocab.tiktoken not found"),
    ],
)
def test_startup_errors_are_one_line_before_listening(args, message, tmp_path, small_checkpoint, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_num_seq: 8\n")
    args = [a.replace("{bad}", str(bad)) for a in args]
    if "--model" not in args:
        args += ["--model", str(small_checkpoint)]
    assert serve.main(args + ["--port", "1"]) == 1  # returns before binding anything
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.slow  # a real server process
def test_cors_root_path_request_log_and_tls(tmp_path):
    """The server-side vLLM flags on a live server (scripted engine): CORS preflight and headers for the allowed
    origin only, a root path, one log line per request, HTTPS with the given key and certificate."""
    from server_utils import REPO, free_port

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
        + ["-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    port, log = free_port(), tmp_path / "server.log"
    cmd = [sys.executable, "-m", "gptoss_jax.serve", "--port", str(port), "--no-warmup", "--log-level", "info"]
    cmd += ["--test-engine", str(REPO / "tests" / "scripted_engine.py") + ":make_engine"]
    cmd += ["--allowed-origins", '["http://app.example"]', "--root-path", "/api", "--enable-log-requests"]
    cmd += ["--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=out, stderr=out)
    url = f"https://127.0.0.1:{port}"
    try:
        with httpx.Client(verify=False, timeout=5) as client:
            for _ in range(300):
                assert proc.poll() is None, log.read_text()[-3000:]
                try:
                    if client.get(url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.3)
            else:
                pytest.fail(log.read_text()[-3000:])
            pre = client.options(
                url + "/v1/models",
                headers={"Origin": "http://app.example", "Access-Control-Request-Method": "POST"},
            )
            assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://app.example"
            other = client.get(url + "/v1/models", headers={"Origin": "http://evil.example"})
            assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
            # behind a proxy that strips /api: requests come without it, and the app knows its public prefix
            models = client.get(url + "/v1/models", headers={"Origin": "http://app.example"})
            assert models.json()["data"][0]["id"] == "gpt-oss-demo"
            assert models.headers["access-control-allow-origin"] == "http://app.example"
    finally:
        proc.terminate()
        proc.wait(20)
    text = log.read_text()
    assert "request GET /api/v1/models -> 200 in " in text and "request OPTIONS /api/v1/models -> 200" in text
