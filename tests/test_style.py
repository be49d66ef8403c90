"""The tree stays as `ruff format` and `ruff check` leave it (pyproject.toml: 120 columns, import order)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")


@pytest.mark.skipif(RUFF is None, reason="ruff is in the dev extra")
@pytest.mark.parametrize("args", [["check", "--output-format", "concise"], ["format", "--check"]])
def test_ruff(args):
    out = subprocess.run([RUFF, *args, "."], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
