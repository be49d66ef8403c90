"""Tiny gpt-oss shapes used for golden parity with Hugging Face transformers.

Each differs in head counts, KV heads, expert counts and top-k; windows are shorter than the
sequences, and sinks are large so a wrong sink treatment shows. `tools/make_parity_fixtures.py`
writes each checkpoint with `random_weights.write_checkpoint(seed=...)` and records transformers'
logits for it; the tests rebuild the identical checkpoint from the same seed.

Seeds are chosen so that no routing decision is a near-tie: the gap between the k-th and (k+1)-th
router logit is at least `MIN_ROUTER_MARGIN` everywhere (checked by tests/test_parity.py). bf16
rounds router logits by ~0.004, so a smaller gap lets any bf16 implementation (transformers' own
included) pick a different expert, a discrete jump that says nothing about the arithmetic.
"""

import copy

from gptoss_jax.random_weights import DEMO_CONFIG

MIN_ROUTER_MARGIN = 0.008


def _config(**overrides):
    cfg = copy.deepcopy(DEMO_CONFIG)
    cfg.update(overrides)
    cfg["layer_types"] = [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg["num_hidden_layers"])
    ]
    return cfg


PARITY = {
    "small": dict(
        config=_config(
            num_hidden_layers=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            experts_per_token=2,
            vocab_size=512,
            hidden_size=64,
            intermediate_size=64,
            head_dim=16,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=8,
            eos_token_id=1,
            pad_token_id=0,
        ),
        seed=11,
        sink_scale=3.0,
        seq_len=40,
    ),
    "wide": dict(
        config=_config(
            num_hidden_layers=4,
            num_local_experts=8,
            num_experts_per_tok=4,
            experts_per_token=4,
            vocab_size=384,
            hidden_size=128,
            intermediate_size=96,
            head_dim=16,
            num_attention_heads=8,
            num_key_value_heads=4,
            sliding_window=16,
            eos_token_id=1,
            pad_token_id=0,
        ),
        seed=226,
        sink_scale=4.0,
        seq_len=48,
    ),
}
