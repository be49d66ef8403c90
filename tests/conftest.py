import os
from pathlib import Path

# Sharding tests need several devices; on CPU XLA simulates them. The tests' programs are tiny and run a few times
# each, so LLVM's optimisation of the machine code XLA emits (backend optimisation level 0) is skipped: it was most of
# each compilation and buys the tests nothing; XLA's own passes over the program are as before. Must precede the first
# jax import; added once: the pytest-xdist workers inherit the controller's environment, where this has run already.
os.environ["XLA_FLAGS"] = " ".join(
    dict.fromkeys(
        os.environ.get("XLA_FLAGS", "").split()
        + ["--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"]
    )
)
# Engines built by the tests keep their compiled steps to themselves (tests/test_runtime.py turns the persistent
# cache on in folders of its own); servers the tests start inherit this.
os.environ.setdefault("GPTOSS_JAX_COMPILE_CACHE", "off")

import gc

import jax
import pytest
from parity_configs import PARITY

from gptoss_jax import random_weights

REPO = Path(__file__).resolve().parent.parent
SHARED_TOKENIZER = REPO.parent / "shared" / "tokenizer"

# Tests never download: the rank file comes from ../shared/tokenizer (see its README).
if SHARED_TOKENIZER.exists():
    os.environ.setdefault("TIKTOKEN_ENCODINGS_BASE", str(SHARED_TOKENIZER))


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop JAX's compiled programs after each test module. Each CPU executable holds ~14 memory maps, and the whole
    suite compiles past Linux's 65,530 maps per process (`vm.max_map_count`): XLA then segfaults in a compilation."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def parity_checkpoints(tmp_path_factory):
    """name -> folder of each PARITY checkpoint, written exactly as the golden fixtures were."""
    out = {}
    for name, spec in PARITY.items():
        path = tmp_path_factory.mktemp(f"parity-{name}")
        random_weights.write_checkpoint(
            path, spec["config"], seed=spec["seed"], sink_scale=spec["sink_scale"], progress=False
        )
        out[name] = path
    return out


@pytest.fixture(scope="session")
def small_checkpoint(parity_checkpoints):
    return parity_checkpoints["small"]
