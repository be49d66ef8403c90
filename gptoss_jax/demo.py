"""The built-in demo checkpoint: a tiny random gpt-oss with the real vocabulary, written on first use.

It lets every entry point (generate, serve, notebooks) run on a fresh machine with no weights.
Its outputs are random text: it demonstrates the machinery, not the model.
"""

import json
import os
from pathlib import Path

from gptoss_jax import random_weights, runtime

SEED = 0


def checkpoint_path() -> Path:
    """Folder of the demo checkpoint (in `runtime.home()`: `$GPTOSS_JAX_HOME`, default `~/.cache/gptoss_jax`)."""
    home = runtime.home()
    path = home / "demo-checkpoint"
    stamp = path / "config.json"
    if not stamp.exists() or json.loads(stamp.read_text()) != random_weights.DEMO_CONFIG:
        tmp = home / f"demo-checkpoint.tmp{os.getpid()}"
        random_weights.write_checkpoint(tmp, random_weights.DEMO_CONFIG, seed=SEED, progress=False)
        if path.exists():
            for f in path.iterdir():
                f.unlink()
            path.rmdir()
        tmp.rename(path)
    return path
