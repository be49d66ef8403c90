"""Regenerate tests/golden/*.npz: transformers' logits for each tiny checkpoint in tests/parity_configs.py.

Writes each checkpoint with our random-checkpoint writer (same seed as the tests), then runs
`tools/make_golden.py` under a Python that has torch + transformers (default: /work/venvs/hf311):

    .venv/bin/python tools/make_parity_fixtures.py [--hf-python PATH]
"""

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from gptoss_jax import random_weights  # noqa: E402
from parity_configs import PARITY  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf-python", default="/work/venvs/hf311/bin/python")
    ap.add_argument("--greedy-tokens", type=int, default=24)
    args = ap.parse_args()
    out_dir = REPO / "tests" / "golden"
    out_dir.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in PARITY.items():
            ckpt = random_weights.write_checkpoint(Path(tmp) / name, spec["config"], seed=spec["seed"],
                                                   sink_scale=spec["sink_scale"], progress=False)
            subprocess.run([args.hf_python, str(REPO / "tools" / "make_golden.py"), "--checkpoint", str(ckpt),
                            "--out", str(out_dir / f"{name}.npz"), "--seq-len", str(spec["seq_len"]),
                            "--greedy-tokens", str(args.greedy_tokens), "--seed", str(spec["seed"])], check=True)


if __name__ == "__main__":
    main()
