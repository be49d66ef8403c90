import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sharding import distributed

REPO = Path(__file__).resolve().parent.parent


def test_single_host_is_a_no_op(monkeypatch):
    for var in ("GPTOSS_COORDINATOR", "GPTOSS_NUM_PROCESSES", "GPTOSS_PROCESS_ID", "GPTOSS_AUTO_CLUSTER"):
        monkeypatch.delenv(var, raising=False)
    assert distributed.initialize() is False


def test_incomplete_settings_rejected(monkeypatch):
    monkeypatch.setenv("GPTOSS_COORDINATOR", "127.0.0.1:1234")
    with pytest.raises(ValueError, match=r"missing \['num_processes', 'process_id'\]"):
        distributed.initialize()
    with pytest.raises(ValueError, match="process_id=3 must be in"):
        distributed.initialize("127.0.0.1:1", 2, 3)


@pytest.mark.slow  # two processes form one mesh
def test_two_cpu_processes_form_one_mesh(small_checkpoint):
    """Two real processes on loopback, 4 CPU devices each: expert parallelism across 'hosts'."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
        PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "distributed_worker.py"), str(port), str(i), str(small_checkpoint)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, out[-3000:]
        assert f"process {i}: ok" in out
