"""The README's first command and its curl and Python examples, taken from README.md and run as written, so the
README and the code cannot drift apart.

What runs verbatim: the serving part of the first command (everything after its `pip install`, i.e.
`TIKTOKEN_ENCODINGS_BASE=... .venv/bin/python -m gptoss_jax.serve --port 8000`), the curl block and the Python
block. The part before it (`python3.12 -m venv .venv && .venv/bin/pip install -q -e ".[serve]"`) is not run here:
it would download and install every dependency again; CI builds that very `.venv` with the README's second command
(`.ci/run`), and the test checks the text of that part instead. Needs port 8000 free, as the examples name it.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from server_utils import REPO, optimized_xla_flags

pytestmark = pytest.mark.slow  # a real server process on the demo checkpoint
README = (REPO / "README.md").read_text()
VENV_PART = 'python3.12 -m venv .venv && .venv/bin/pip install -q -e ".[serve]" && '


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def _first_command() -> str:
    return _blocks("bash")[0].splitlines()[0]


def test_first_command_builds_the_env_then_serves():
    first = _first_command()
    assert first.startswith(VENV_PART), first
    assert "-m gptoss_jax.serve --port 8000" in first


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory):
    if not (REPO / ".venv" / "bin" / "python").exists():
        pytest.fail(f"{REPO / '.venv'} is missing: build it with the README's second command first")
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", 8000)) == 0:
            pytest.fail("port 8000 is in use; the README's examples need it")
    serve_part = _first_command()[len(VENV_PART) :]
    home = tmp_path_factory.mktemp("home")
    log = home / "server.log"
    env = dict(os.environ, JAX_PLATFORMS="cpu", GPTOSS_JAX_HOME=str(home), XLA_FLAGS=optimized_xla_flags())
    with open(log, "w") as out:
        proc = subprocess.Popen(
            ["bash", "-c", serve_part], cwd=REPO, env=env, stdout=out, stderr=out, start_new_session=True
        )
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            assert proc.poll() is None, f"the README's server exited: {log.read_text()[-3000:]}"
            try:
                if httpx.get("http://127.0.0.1:8000/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"not healthy after 300 s: {log.read_text()[-3000:]}")
        yield log
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_curl_example(readme_server):
    (curl,) = [b for b in _blocks("bash") if b.startswith("curl http://127.0.0.1:8000")]
    env = {k: v for k, v in os.environ.items() if k != "KEY"}
    out = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr
    body = httpx.Response(200, content=out.stdout).json()
    assert body["object"] == "chat.completion", body
    assert body["choices"][0]["message"]["role"] == "assistant" and body["usage"]["completion_tokens"] >= 1


def test_python_example(readme_server):
    (code,) = [b for b in _blocks("python") if "from openai import OpenAI" in b]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip(), "the example printed nothing"
