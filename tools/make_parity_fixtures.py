"""Regenerate tests/golden/*.npz: transformers' logits for each tiny checkpoint in tests/parity_configs.py.

Writes each checkpoint with our random-checkpoint writer (same seed as the tests), then runs
`tools.make_golden` under a Python that has torch + transformers (default: /work/venvs/hf311):

    .venv/bin/python -m tools.make_parity_fixtures [--hf-python PATH]
"""

import argparse
import subprocess
import tempfile
from pathlib import Path

from gptoss_jax import random_weights
from tests.parity_configs import PARITY

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf-python", default="/work/venvs/hf311/bin/python")
    ap.add_argument("--greedy-tokens", type=int, default=24)
    args = ap.parse_args()
    out_dir = REPO / "tests" / "golden"
    out_dir.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in PARITY.items():
            ckpt = random_weights.write_checkpoint(
                Path(tmp) / name, spec["config"], seed=spec["seed"], sink_scale=spec["sink_scale"], progress=False
            )
            subprocess.run(
                [
                    args.hf_python,
                    "-m",
                    "tools.make_golden",
                    "--checkpoint",
                    str(ckpt),
                    "--out",
                    str(out_dir / f"{name}.npz"),
                    "--seq-len",
                    str(spec["seq_len"]),
                    "--greedy-tokens",
                    str(args.greedy_tokens),
                    "--seed",
                    str(spec["seed"]),
                ],
                cwd=REPO,
                check=True,
            )


if __name__ == "__main__":
    main()
