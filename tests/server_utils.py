"""Start a real `python -m gptoss_jax.serve` process on 127.0.0.1 for the server tests."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def optimized_xla_flags(*drop: str) -> str:
    """The tests' `XLA_FLAGS` without conftest's LLVM level 0 (and without `drop`), for a process whose programs run
    step after step over the real vocabulary (a server, a notebook's engine): there the unoptimised machine code
    costs more than its optimisation saves (the README's two examples against its server: 113 -> 18 s)."""
    off = ("--xla_backend_optimization_level=0", *drop)
    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if f not in off)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(
        self,
        args: list[str],
        env: dict | None = None,
        timeout: float = 240.0,
        log_path: Path | None = None,
        on_health=None,
    ):
        """Start the server and wait until /health is 200 (`on_health` sees every /health response meanwhile)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        e = dict(os.environ)
        e.update(env or {})
        e.setdefault("JAX_PLATFORMS", "cpu")
        cmd = [
            sys.executable,
            "-m",
            "gptoss_jax.serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *args,
        ]
        self.log = open(log_path, "w") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=e, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.tail()}")
            try:
                health = httpx.get(self.url + "/health", timeout=2)
                if on_health is not None:
                    on_health(health)
                if health.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout}s: {self.tail()}")

    def tail(self) -> str:
        if self.log_path and self.log_path.exists():
            return self.log_path.read_text()[-4000:]
        return ""

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: 'name' -> value (first sample of each name)."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        out = {}
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
            if m and m.group(1) not in out:
                out[m.group(1)] = float(m.group(3))
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log is not subprocess.DEVNULL:
            self.log.close()


def collect_chat_stream(stream) -> dict:
    """Concatenate a streamed chat completion (openai client chunks) per choice."""
    out: dict[int, dict] = {}
    usage = None
    first_delta: dict[int, object] = {}
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            acc = out.setdefault(
                ch.index,
                {"content": "", "reasoning": "", "tools": {}, "finish_reason": None, "roles": 0, "logprobs": []},
            )
            d = ch.delta
            first_delta.setdefault(ch.index, d)
            if d.role:
                acc["roles"] += 1
            if d.content:
                acc["content"] += d.content
            extra = d.model_extra or {}
            if extra.get("reasoning_content"):
                acc["reasoning"] += extra["reasoning_content"]
            for tc in d.tool_calls or []:
                t = acc["tools"].setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    assert t["id"] is None, "tool call id sent twice"
                    t["id"] = tc.id
                if tc.function and tc.function.name:
                    t["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    assert t["id"] is not None, "arguments before the tool call's id"
                    t["arguments"] += tc.function.arguments
            if ch.logprobs and ch.logprobs.content:
                acc["logprobs"] += ch.logprobs.content
            if ch.finish_reason:
                assert acc["finish_reason"] is None, "two finish chunks"
                acc["finish_reason"] = ch.finish_reason
    for i, d in first_delta.items():
        assert d.role == "assistant", "the first chunk of each choice carries the role"
    return {"choices": out, "usage": usage}
