"""Write a random gpt-oss checkpoint of any size in the exact published layout.

    python -m tools.make_checkpoint --preset gpt-oss-20b --out /tmp/gpt-oss-20b-random
    python -m tools.make_checkpoint --config my_config.json --out DIR --layout original
    python -m tools.make_checkpoint --preset gpt-oss-120b --eagle3 --out /tmp/gpt-oss-120b-eagle3-random

MXFP4 expert blocks/scales, bf16 elsewhere, sharded with an index past --max-shard-gb. Streams one
tensor at a time, so the 120b shape needs little host memory. With --eagle3 it writes a random EAGLE-3 drafter
for that target instead, in the published `LlamaForCausalLMEagle3` layout (docs/speculative.md).
"""

import argparse
import json
from pathlib import Path

from gptoss_jax import config, random_weights


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="gpt-oss-20b or gpt-oss-120b")
    src.add_argument("--config", help="a Hugging Face config.json to follow")
    ap.add_argument("--out", required=True, help="checkpoint folder to write")
    ap.add_argument("--layout", choices=["hf", "original"], default="hf")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-shard-gb", type=float, default=4.0)
    ap.add_argument("--sink-scale", type=float, default=1.0, help="std of the random sink logits")
    ap.add_argument("--eagle3", action="store_true", help="write a random EAGLE-3 drafter for this target instead")
    ap.add_argument("--draft-vocab-size", type=int, help="the drafter's vocabulary (default: 32000, or V/4 if smaller)")
    ap.add_argument("--no-embed", action="store_true", help="the drafter shares the target's embedding")
    args = ap.parse_args(argv)
    file = Path(args.config) if args.config else config.PRESETS_DIR / f"{args.preset}.json"
    hf = json.loads(file.read_text())
    config.from_hf_dict(hf, str(file))  # validate before writing gigabytes
    if args.eagle3:
        extra = {} if args.draft_vocab_size is None else {"draft_vocab_size": args.draft_vocab_size}
        drafter = random_weights.eagle3_config(hf, **extra)
        path = random_weights.write_eagle3_drafter(args.out, drafter, hf, seed=args.seed, embed=not args.no_embed)
        print(f"wrote {path}")
        return
    path = random_weights.write_checkpoint(
        args.out,
        hf,
        seed=args.seed,
        layout=args.layout,
        max_shard_bytes=int(args.max_shard_gb * 2**30),
        sink_scale=args.sink_scale,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
