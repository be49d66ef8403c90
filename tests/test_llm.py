import json
import subprocess
import sys

import numpy as np
import pytest
from parity_configs import PARITY

from gptoss_jax import LLM, SamplingParams, random_weights


@pytest.fixture(scope="module")
def llm(small_checkpoint):
    return LLM(small_checkpoint, dtype="float32", progress=False)


def _prompts(n, seed=0, vocab=512):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, size=int(rng.integers(3, 30))).tolist() for _ in range(n)]


def test_result_shape_and_greedy_matches_full_forward(llm):
    ids = _prompts(1)[0]
    out = llm.generate(
        prompt_token_ids=[ids],
        sampling_params=SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[]),
        use_tqdm=False,
    )
    assert len(out) == 1 and out[0].prompt_token_ids == ids
    c = out[0].outputs[0]
    assert len(c.token_ids) == 12 and c.finish_reason == "length" and c.text is None
    # the KV-cached decode must pick the argmax of a fresh full forward at every step
    seq = list(ids)
    for tok in c.token_ids:
        assert tok == int(np.argmax(llm.logits(seq)[-1]))
        seq.append(tok)


@pytest.mark.slow  # a long batch against each prompt alone (test_engine covers the engine at a smaller size)
def test_batch_of_different_lengths_equals_one_by_one(llm):
    prompts = _prompts(5, seed=1)
    sp = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[])
    batched = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    for p, b in zip(prompts, batched):
        alone = llm.generate(prompt_token_ids=[p], sampling_params=sp, use_tqdm=False)[0]
        assert b.outputs[0].token_ids == alone.outputs[0].token_ids


def test_seeded_sampling_reproducible_regardless_of_batch(llm):
    prompts = _prompts(3, seed=2)
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=8, stop_token_ids=[])
    alone = llm.generate(prompt_token_ids=[prompts[0]], sampling_params=sp, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(temperature=0.7, seed=99, max_tokens=8, stop_token_ids=[])
    mixed = llm.generate(prompt_token_ids=prompts, sampling_params=[sp, other, other], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    again = llm.generate(
        prompt_token_ids=[prompts[0]],
        sampling_params=SamplingParams(
            temperature=1.0, top_p=0.9, top_k=50, seed=1235, max_tokens=8, stop_token_ids=[]
        ),
        use_tqdm=False,
    )
    assert again[0].outputs[0].token_ids != alone


def test_top_k_1_is_greedy(llm):
    p = _prompts(1, seed=3)
    greedy = (
        llm.generate(
            prompt_token_ids=p,
            sampling_params=SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[]),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    k1 = (
        llm.generate(
            prompt_token_ids=p,
            sampling_params=SamplingParams(temperature=1.5, top_k=1, seed=5, max_tokens=6, stop_token_ids=[]),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    assert greedy == k1


def test_stop_token_ends_and_is_excluded(llm):
    p = _prompts(1, seed=4)
    free = (
        llm.generate(
            prompt_token_ids=p,
            sampling_params=SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[]),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    stop = free[3]
    out = llm.generate(
        prompt_token_ids=p,
        sampling_params=SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == free[: free.index(stop)]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(seed="x"), "seed"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(temperature=float("nan")), "temperature"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{match}="):
        SamplingParams(**kwargs)


def test_bad_prompts(llm):
    with pytest.raises(ValueError, match=r"prompt_token_ids\[0\]: token id 512 is outside"):
        llm.generate(prompt_token_ids=[[1, 512]], use_tqdm=False)
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate(prompt_token_ids=[[]], use_tqdm=False)
    with pytest.raises(ValueError, match="pass prompt_token_ids"):
        llm.generate(["hello"], use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        llm.generate(use_tqdm=False)
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(prompt_token_ids=[[1]], sampling_params=[SamplingParams()] * 2, use_tqdm=False)
    with pytest.raises(ValueError, match="dtype"):
        LLM(None, dtype="float16")


def test_context_limit(small_checkpoint):
    llm = LLM(small_checkpoint, dtype="float32", max_model_len=20, progress=False)
    with pytest.raises(ValueError, match="context limit is 20"):
        llm.generate(prompt_token_ids=[list(range(2, 22))], use_tqdm=False)
    out = llm.generate(
        prompt_token_ids=[list(range(2, 17))],
        sampling_params=SamplingParams(temperature=0, max_tokens=50, stop_token_ids=[]),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_sliding_layer_zero_ignores_tokens_outside_window(tmp_path):
    """Layer 0 is sliding: with one layer, position i must not see position i - window."""
    spec = PARITY["small"]
    W = spec["config"]["sliding_window"]
    for layers, sees_far_token in ((1, False), (2, True)):
        cfg = dict(
            spec["config"], num_hidden_layers=layers, layer_types=["sliding_attention", "full_attention"][:layers]
        )
        path = random_weights.write_checkpoint(tmp_path / str(layers), cfg, seed=3, progress=False)
        llm = LLM(path, dtype="float32", progress=False)
        ids = list(range(2, 2 + 3 * W))
        changed = list(ids)
        changed[len(ids) - 1 - W] = 300  # exactly `window` positions before the last token
        a, b = llm.logits(ids)[-1], llm.logits(changed)[-1]
        assert (not np.allclose(a, b, atol=1e-6)) == sees_far_token, layers
        changed[len(ids) - W] = 300  # inside the window of the last token: always seen
        assert not np.allclose(a, llm.logits(changed)[-1], atol=1e-6)


def test_demo_checkpoint_text_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("GPTOSS_JAX_HOME", str(tmp_path))
    llm = LLM(dtype="float32", progress=False)
    assert llm.config.vocab_size == 201088 and llm.tokenizer is not None
    out = llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=4, stop_token_ids=[]), use_tqdm=False
    )[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("The capital of France is")
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)


@pytest.mark.slow  # the CLI as subprocesses
def test_cli_json_and_errors(small_checkpoint):
    cmd = [
        sys.executable,
        "-m",
        "gptoss_jax.generate",
        "--model",
        str(small_checkpoint),
        "--prompt-ids",
        "5,6,7",
        "--max-tokens",
        "4",
        "--json",
        "--dtype",
        "float32",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["prompt_token_ids"] == [5, 6, 7] and len(out["token_ids"]) <= 4
    bad = subprocess.run(cmd[:6] + ["5,x"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "comma-separated integers" in bad.stderr
    bad = subprocess.run(
        cmd[:3] + ["--prompt-ids", "1", "--model", "/nonexistent"], capture_output=True, text=True, timeout=300
    )
    assert bad.returncode == 1 and "checkpoint folder not found" in bad.stderr
