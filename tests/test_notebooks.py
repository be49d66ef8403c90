"""The notebooks in notebooks/ execute top to bottom on the demo checkpoint (CPU) and save their main plot.

Each runs in a fresh kernel (nbclient); a failing cell fails the test with its traceback. Figures go to a
temporary folder (`GPTOSS_JAX_FIGURES`), so running the tests never touches docs/.
"""

import os
from pathlib import Path

import pytest
from server_utils import optimized_xla_flags

pytestmark = pytest.mark.slow  # each notebook runs top to bottom in a kernel of its own

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
CASES = {  # notebook -> the figure it saves
    "quickstart.ipynb": "notebook_quickstart.png",
    "inside_gpt_oss.ipynb": "inside_gpt_oss.png",
    "benchmarks.ipynb": "benchmarks_curves.png",
    "flax_research.ipynb": "flax_research.png",
}


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    env = dict(os.environ)
    # conftest simulates 8 CPU devices for the sharding tests; the notebooks want the plain machine, optimised
    flags = optimized_xla_flags("--xla_force_host_platform_device_count=8")
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    # the notebooks' engines share compiled steps through a persistent cache of their own
    env.update(
        JAX_PLATFORMS="cpu", MPLBACKEND="Agg", GPTOSS_JAX_COMPILE_CACHE=str(tmp_path_factory.mktemp("jax-cache"))
    )
    for var in ("GPTOSS_JAX_MODEL", "GPTOSS_JAX_SERVER_URL", "GPTOSS_JAX_RESULTS"):
        env.pop(var, None)  # always the demo checkpoint, a fresh server, the committed results
    return env


@pytest.mark.parametrize("name", list(CASES))
def test_notebook_runs(name, kernel_env, tmp_path):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    client.execute(env=dict(kernel_env, GPTOSS_JAX_FIGURES=str(tmp_path)))
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    figure = tmp_path / CASES[name]
    assert figure.exists() and figure.stat().st_size > 10_000
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_notebooks_are_committed_without_outputs():
    """Outputs are produced in CI (and the main plots are in docs/), not stored in the .ipynb files."""
    for name in CASES:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(nb)
        for c in nb.cells:
            if c.cell_type == "code":
                assert not c.get("outputs") and c.get("execution_count") is None, name
