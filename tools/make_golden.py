"""Make golden outputs for tests/test_parity.py with Hugging Face transformers.

The goldens come from an implementation that shares no code with gptoss_jax:
transformers' own ``GptOssForCausalLM``, run on CPU in float32 with eager
attention (the path that implements attention sinks and the sliding-window
mask directly), after transformers' own MXFP4 -> dense dequantization of the
expert weights.  The parity test then only needs numpy and the .npz file.

Run it with the separate transformers venv (not the project's JAX env):

    /work/venvs/hf311/bin/python -m tools.make_golden \\
        --checkpoint DIR --out golden.npz [--seq-len 40] [--greedy-tokens 24] \\
        [--seed 0] [--prompt-ids 1,2,3]

DIR is a checkpoint in the Hugging Face gpt-oss layout (config.json with an
mxfp4 quantization_config, model.safetensors or a sharded index).  Nothing is
downloaded.

The .npz holds:
    prompt_ids      int32   [T]      the prompt (random from --seed unless given)
    logits          float32 [T, V]   float32 prefill logits, one forward, batch 1
    logits_bf16     float32 [T, V]   the same from the model loaded in bfloat16
    greedy_ids      int32   [N]      greedy continuation (float32 model)
    greedy_margins  float32 [N]      top-1 minus top-2 logit at each greedy step
                                     (a tiny margin means a near tie)
    transformers_version, torch_version   str

Greedy ids come from a plain loop (a full forward over the whole sequence for
every token, argmax of the last logits), and are cross-checked against
``model.generate`` with its KV cache.
"""

import argparse
import gc
import json
import math
import os
import time

import numpy as np
import torch
import transformers
from safetensors import safe_open
from transformers import GenerationConfig, GptOssForCausalLM, Mxfp4Config


def load_model(checkpoint, dtype):
    """Load the checkpoint with transformers' own loader, MXFP4 experts dequantized."""
    model = GptOssForCausalLM.from_pretrained(
        checkpoint,
        local_files_only=True,  # never reach for the hub
        # Without the triton MXFP4 kernels transformers dequantizes anyway; ask for
        # it explicitly.  The Mxfp4Dequantize op writes the experts straight in the
        # dtype of the parameter they load into, i.e. `dtype`.
        quantization_config=Mxfp4Config(dequantize=True),
        dtype=dtype,
        attn_implementation="eager",  # sinks + sliding-window mask spelled out
        experts_implementation="eager",  # plain per-expert loop (default: grouped_mm)
    )
    return model.eval()


def check_dtypes(model, dtype):
    """Every parameter, dequantized experts included, must be in `dtype`."""
    for name, p in model.named_parameters():
        assert p.dtype == dtype, f"{name} is {p.dtype}, expected {dtype}"


def check_rope_and_windows(model, cfg):
    """Check the gpt-oss specifics that transformers derives from config.json."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    assert rope["rope_type"] == "yarn" and rope.get("truncate") is False, rope
    # YaRN / NTK-by-parts with an unrounded correction range (truncate=False), as in
    # the gpt-oss reference; recomputed here and compared with transformers' buffer.
    d, base, factor = cfg["head_dim"], cfg["rope_theta"], rope["factor"]
    ctx = rope["original_max_position_embeddings"]
    freq = base ** (np.arange(0, d, 2, dtype=np.float64) / d)
    low = d / 2 * math.log(ctx / (rope["beta_fast"] * 2 * math.pi)) / math.log(base)
    high = d / 2 * math.log(ctx / (rope["beta_slow"] * 2 * math.pi)) / math.log(base)
    keep = 1 - np.clip((np.arange(d // 2) - low) / (high - low), 0, 1)
    inv_freq = keep / freq + (1 - keep) / (factor * freq)
    rotary = model.model.rotary_emb
    np.testing.assert_allclose(rotary.inv_freq.double().numpy(), inv_freq, rtol=1e-6)
    assert abs(rotary.attention_scaling - (0.1 * math.log(factor) + 1)) < 1e-12
    # gpt-oss: banded (sliding-window) attention on even layers, full on odd ones.
    for i, layer in enumerate(model.model.layers):
        want = cfg["sliding_window"] if i % 2 == 0 else None
        assert layer.self_attn.sliding_window == want, f"layer {i}: {model.config.layer_types[i]}"


def check_expert_dequant(model, checkpoint):
    """Dequantize layer 0, expert 0 of gate_up_proj with numpy; compare with transformers."""
    index = os.path.join(checkpoint, "model.safetensors.index.json")
    weight_map = json.load(open(index))["weight_map"] if os.path.exists(index) else {}
    name = "model.layers.0.mlp.experts.gate_up_proj"

    def read(key):  # expert 0 of a stored tensor
        with safe_open(os.path.join(checkpoint, weight_map.get(key, "model.safetensors")), "pt") as f:
            return f.get_slice(key)[0].numpy()

    blocks, scales = read(name + "_blocks"), read(name + "_scales")  # [2I, H/32, 16], [2I, H/32]
    fp4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    vals = np.stack([fp4[blocks & 15], fp4[blocks >> 4]], -1)  # low nibble first
    w = np.ldexp(vals.reshape(*scales.shape, 32), scales.astype(np.int32)[..., None] - 127)
    got = model.model.layers[0].mlp.experts.gate_up_proj[0]  # transformers keeps [H, 2I]
    np.testing.assert_array_equal(got.detach().float().numpy(), w.reshape(len(w), -1).T)


@torch.inference_mode()
def greedy_plain(model, ids, n):
    """N greedy tokens, one full forward (no cache) per token; also the top-2 margins."""
    seq, margins = ids, []
    for _ in range(n):
        last = model(input_ids=seq, use_cache=False).logits[0, -1].float()
        top2 = last.topk(2).values
        margins.append((top2[0] - top2[1]).item())
        seq = torch.cat([seq, last.argmax().view(1, 1)], dim=1)
    return seq[0, ids.shape[1] :], np.array(margins, np.float32)


@torch.inference_mode()
def greedy_generate(model, ids, n):
    # Neutral generation defaults: the checkpoint's generation_config (sampling,
    # EOS list, pad id) would otherwise fill in every option left at None.
    model.generation_config = GenerationConfig()
    out = model.generate(
        ids,
        # Pass the mask explicitly: otherwise generate infers one from pad tokens in
        # the prompt (a random prompt can contain the pad id) and shifts positions.
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=n,
        # No EOS, so nothing can stop early.  (min_new_tokens would instead set the
        # EOS logit to -inf, which can change the argmax.)
        eos_token_id=None,
        pad_token_id=None,
    )
    return out[0, ids.shape[1] :]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq-len", type=int, default=40)
    ap.add_argument("--greedy-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-ids", help="comma-separated ids (overrides --seq-len/--seed)")
    args = ap.parse_args()
    t0 = time.time()
    torch.manual_seed(args.seed)
    cfg = json.load(open(os.path.join(args.checkpoint, "config.json")))
    vocab = cfg["vocab_size"]

    if args.prompt_ids:
        prompt = np.array([int(t) for t in args.prompt_ids.split(",")], np.int32)
    else:
        prompt = np.random.default_rng(args.seed).integers(0, vocab, args.seq_len).astype(np.int32)
    assert prompt.min() >= 0 and prompt.max() < vocab, "prompt id out of vocabulary"
    ids = torch.from_numpy(prompt.astype(np.int64))[None]  # batch 1

    # float32 reference: prefill logits, greedy ids.
    model = load_model(args.checkpoint, torch.float32)
    check_dtypes(model, torch.float32)
    check_rope_and_windows(model, cfg)
    check_expert_dequant(model, args.checkpoint)
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=False).logits[0].numpy()
    greedy, margins = greedy_plain(model, ids, args.greedy_tokens)
    generated = greedy_generate(model, ids, args.greedy_tokens)
    assert len(generated) == args.greedy_tokens, "generate stopped early"
    agree = torch.equal(generated, greedy)
    if not agree:
        step = int((generated != greedy).nonzero()[0])
        print(
            f"WARNING: generate differs from the plain argmax loop at step {step} "
            f"(margin {margins[step]:.3g}); keeping the plain loop's ids"
        )
    del model
    gc.collect()

    # bfloat16 model, prefill only: a second, coarser reference.
    model = load_model(args.checkpoint, torch.bfloat16)
    check_dtypes(model, torch.bfloat16)
    with torch.inference_mode():
        logits_bf16 = model(input_ids=ids, use_cache=False).logits[0].float().numpy()
    del model

    np.savez(
        args.out,
        prompt_ids=prompt,
        logits=logits,
        logits_bf16=logits_bf16,
        greedy_ids=greedy.numpy().astype(np.int32),
        greedy_margins=margins,
        transformers_version=np.array(transformers.__version__),
        torch_version=np.array(torch.__version__),
    )
    print(
        f"wrote {args.out} in {time.time() - t0:.1f}s "
        f"(transformers {transformers.__version__}, torch {torch.__version__})"
    )
    print(f"  prompt_ids {prompt.shape}  first {prompt[:8].tolist()}")
    print(f"  logits {logits.shape}  std {logits.std():.4f}  max|fp32-bf16| {np.abs(logits - logits_bf16).max():.4f}")
    print(
        f"  greedy_ids {tuple(greedy.shape)}  first {greedy[:8].tolist()}  "
        f"min margin {margins.min():.3g}  generate agrees: {agree}"
    )


if __name__ == "__main__":
    main()
