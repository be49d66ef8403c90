"""Peer measurement: the same gpt-oss shape through Hugging Face transformers (torch) on the same GPU.

Random bf16 weights at the preset's shape, initialised on the GPU (no checkpoint); transformers'
default gpt-oss path (eager attention, its own expert implementation). Greedy `generate` of
`--new-tokens` after a `--prompt-len` random prompt, per batch size; reports output tok/s per user
and in total, prefill time, and time per output token. Run it in its own process (JAX and torch
would otherwise compete for GPU memory):

    python -m tools.peer_transformers --preset gpt-oss-20b --batch 1,64 --out peer.json
"""

import argparse
import json
import time
from pathlib import Path

import torch
import transformers
from transformers import GptOssConfig, GptOssForCausalLM

PRESETS = Path(__file__).resolve().parent.parent / "configs"


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-oss-20b")
    ap.add_argument("--batch", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", default="peer_transformers.json")
    args = ap.parse_args()

    raw = json.loads((PRESETS / f"{args.preset}.json").read_text())
    raw.pop("quantization_config", None)  # dense bf16 experts: transformers' plain path
    cfg = GptOssConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GptOssForCausalLM(cfg).to(torch.bfloat16).eval()
    result = {
        "preset": args.preset,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "attn": model.config._attn_implementation,
        "runs": [],
    }
    gen = dict(do_sample=False, eos_token_id=None, pad_token_id=None, use_cache=True)
    for B in [int(b) for b in args.batch.split(",")]:
        ids = torch.randint(0, cfg.vocab_size, (B, args.prompt_len), device="cuda")
        mask = torch.ones_like(ids)
        with torch.inference_mode():
            model.generate(ids[:, :16], attention_mask=mask[:, :16], max_new_tokens=2, min_new_tokens=2, **gen)
            t_prefill = timed(lambda: model(ids, attention_mask=mask))
            t_total = timed(
                lambda: model.generate(
                    ids, attention_mask=mask, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, **gen
                )
            )
        tpot = (t_total - t_prefill) / max(args.new_tokens - 1, 1)
        run = {
            "batch": B,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "prefill_s": t_prefill,
            "total_s": t_total,
            "tpot_s": tpot,
            "tok_per_s_per_user": 1 / tpot,
            "tok_per_s_total": B / tpot,
        }
        result["runs"].append(run)
        print(
            f"transformers B={B}: prefill {t_prefill * 1e3:.0f} ms, TPOT {tpot * 1e3:.1f} ms, "
            f"{B / tpot:.0f} tok/s total",
            flush=True,
        )
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
