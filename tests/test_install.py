"""A normal (non-editable) install works outside the source tree: the wheel ships configs/."""

import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_installed_outside_the_tree_loads_presets_and_profiles(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(REPO), "-w", str(tmp_path / "dist")],
        check=True,
        cwd=tmp_path,
    )
    wheel = next((tmp_path / "dist").glob("gptoss_jax-*.whl"))
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    # The wheel alone goes into the fresh environment; its dependencies (jax, ...) are borrowed from this one's
    # site-packages as a plain path entry, whose .pth files (this checkout's editable install) are not run.
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)], check=True
    )
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    code = (
        "import gptoss_jax, pathlib; from gptoss_jax import config, engine_config; "
        "assert pathlib.Path(gptoss_jax.__file__).is_relative_to(pathlib.Path(sys.argv[1])), gptoss_jax.__file__; "
        "print(config.preset('gpt-oss-20b').num_experts, config.preset('gpt-oss-120b').num_experts, "
        "engine_config.load('low_latency').decode_steps_per_call, engine_config.load('max_throughput').max_num_seqs)"
    )
    out = subprocess.run(
        [str(python), "-c", "import sys; " + code, str(site)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [
        "32",
        "128",
        str(_profile("low_latency", "decode_steps_per_call")),
        str(_profile("max_throughput", "max_num_seqs")),
    ]


def _profile(name: str, key: str) -> int:
    import yaml

    return yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())[key]


def _requirement_names(reqs: list[str]) -> set[str]:
    import re

    return {re.split(r"[<>=!\[ ;]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


def test_bench_serving_runs_on_the_serve_extra():
    """`pip install gptoss-jax[serve]` is enough for tools/bench_serving.py: every third-party module it imports
    comes from a distribution in the dependencies or the `serve` extra."""
    import ast
    import importlib.metadata
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    allowed = _requirement_names(project["dependencies"] + project["optional-dependencies"]["serve"])
    tree = ast.parse((REPO / "tools" / "bench_serving.py").read_text())
    modules = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    third_party = sorted(m for m in modules if m not in sys.stdlib_module_names and m not in ("gptoss_jax", "tools"))
    assert "httpx" in third_party
    dists = importlib.metadata.packages_distributions()
    for m in third_party:
        names = {d.lower().replace("_", "-") for d in dists[m]}
        assert names & allowed, f"tools/bench_serving.py imports {m} ({names}), not in the serve extra"
