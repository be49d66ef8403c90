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


def test_demo_checkpoint_text_round_trip(demo_llm):
    llm = demo_llm
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


def test_close_context_manager_and_gc_free_device_memory(small_checkpoint):
    """Several LLMs in one process: `close()`, leaving a `with` block, and dropping the last reference each give
    every device buffer back (issue: four LLMs in one process ran out of GPU memory)."""
    import gc

    import jax

    def live():
        gc.collect()
        return {id(a) for a in jax.live_arrays()}

    sp = SamplingParams(temperature=0, max_tokens=3, stop_token_ids=[])
    baseline = live()
    for _ in range(2):
        llm = LLM(small_checkpoint, dtype="float32", progress=False)
        llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=sp, use_tqdm=False)
        assert len(live() - baseline) > 5  # parameters and cache are on the device
        llm.close()
        llm.close()  # twice is harmless
        assert live() - baseline == set()
    with LLM(small_checkpoint, dtype="float32", progress=False) as llm:
        llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=sp, use_tqdm=False)
    assert live() - baseline == set()
    llm = LLM(small_checkpoint, dtype="float32", progress=False)
    llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=sp, use_tqdm=False)
    del llm
    assert live() - baseline == set()


def test_n_completions_per_prompt(llm):
    p = _prompts(1, seed=6)
    sp = SamplingParams(temperature=1.0, seed=7, max_tokens=6, stop_token_ids=[], n=2)
    (out,) = llm.generate(prompt_token_ids=p, sampling_params=sp, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1] and out.outputs[0].token_ids != out.outputs[1].token_ids
    # completion j is the request seeded seed + j
    alone = SamplingParams(temperature=1.0, seed=8, max_tokens=6, stop_token_ids=[])
    again = llm.generate(prompt_token_ids=p, sampling_params=alone, use_tqdm=False)
    assert out.outputs[1].token_ids == again[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=r"SamplingParams.n=0"):
        SamplingParams(n=0)


@pytest.fixture(scope="module")
def demo_llm(tmp_path_factory):
    import os

    home = tmp_path_factory.mktemp("home")
    old = os.environ.get("GPTOSS_JAX_HOME")
    os.environ["GPTOSS_JAX_HOME"] = str(home)
    try:
        with LLM(dtype="float32", progress=False) as llm:
            yield llm
    finally:
        if old is None:
            os.environ.pop("GPTOSS_JAX_HOME")
        else:
            os.environ["GPTOSS_JAX_HOME"] = old


def test_chat_renders_and_splits_as_the_server(demo_llm):
    pytest.importorskip("openai_harmony")
    from gptoss_jax import harmony

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    sp = SamplingParams(temperature=0, max_tokens=4)
    out = demo_llm.chat([messages, messages[1:]], sp, reasoning_effort="low", use_tqdm=False)
    assert [o.prompt_token_ids for o in out] == [
        harmony.Renderer().render_chat(m, [], "low") for m in (messages, messages[1:])
    ]
    parser = harmony.OutputParser(demo_llm.tokenizer)  # the reply's fields are the server parser's, token by token
    deltas = [d for t in out[0].outputs[0].token_ids for d in parser.process(t)] + parser.finish()
    assert out[0].outputs[0].text == "".join(d.text for d in deltas if d.kind == "content")
    # the split of a scripted harmony reply: analysis -> reasoning_content, final -> text, functions.* -> tool_calls
    enc = demo_llm.tokenizer
    reply = enc.encode(
        "<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant<|channel|>final<|message|>4",
        allowed_special="all",
    )
    from gptoss_jax.llm import CompletionOutput

    c = CompletionOutput(0, None, reply, "stop", 200002)
    demo_llm._split_reply(c, harmony.OutputParser(enc))
    assert (c.text, c.reasoning_content, c.tool_calls, c.finish_reason) == ("4", "Add them.", None, "stop")
    call = enc.encode(
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
        allowed_special="all",
    )
    c = CompletionOutput(0, None, call, "stop", 200012)
    demo_llm._split_reply(c, harmony.OutputParser(enc, ["get_weather"]))
    assert (
        c.tool_calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}] and c.finish_reason == "tool_calls"
    )
    with pytest.raises(harmony.RenderError, match="reasoning_effort"):
        demo_llm.chat(messages, reasoning_effort="extreme", use_tqdm=False)


def test_best_of_keeps_the_n_most_likely(llm):
    ids = _prompts(1, seed=4)[0]
    sp = dict(temperature=1.0, seed=21, max_tokens=6, stop_token_ids=[])
    all5 = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(n=5, logprobs=0, **sp), use_tqdm=False)
    ranked = sorted(all5[0].outputs, key=lambda o: -o.cumulative_logprob)
    best = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(n=2, best_of=5, **sp), use_tqdm=False)
    got = best[0].outputs
    assert [o.token_ids for o in got] == [o.token_ids for o in ranked[:2]] and [o.index for o in got] == [0, 1]
    assert got[0].cumulative_logprob >= got[1].cumulative_logprob >= ranked[2].cumulative_logprob
    assert got[0].logprobs is None  # not asked for


def test_ignore_eos_and_bad_words_on_the_real_vocabulary(demo_llm):
    from gptoss_jax.tokenizer import RETURN

    prompt = "The capital of France is"
    force_eos = dict(temperature=0, max_tokens=5, logit_bias={RETURN: 100})
    out = demo_llm.generate(prompt, SamplingParams(**force_eos), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [] and (out.finish_reason, out.stop_reason) == ("stop", RETURN)
    out = demo_llm.generate(prompt, SamplingParams(**force_eos, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [RETURN] * 5 and out.finish_reason == "length"
    # " Paris" is one token; forced by a bias, banned as a bad word (with or without its leading space)
    (paris,) = demo_llm.tokenizer.encode(" Paris")
    forced = dict(temperature=0, max_tokens=4, stop_token_ids=[], logit_bias={paris: 100})
    assert demo_llm.generate(prompt, SamplingParams(**forced), use_tqdm=False)[0].outputs[0].token_ids == [paris] * 4
    assert paris in {w[0] for w in demo_llm.engine.bad_words_ids(["Paris"])}
    out = demo_llm.generate(prompt, SamplingParams(**forced, bad_words=["Paris"]), use_tqdm=False)[0].outputs[0]
    assert paris not in out.token_ids and len(out.token_ids) == 4


def test_min_tokens_keeps_early_stop_strings_in_the_text(demo_llm):
    (paris,) = demo_llm.tokenizer.encode(" Paris")
    sp = dict(temperature=0, max_tokens=8, stop_token_ids=[], logit_bias={paris: 100}, stop=[" Paris"])
    out = demo_llm.generate("The capital of France is", SamplingParams(**sp), use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.text, out.stop_reason) == ([paris], "", " Paris")
    out = demo_llm.generate("The capital of France is", SamplingParams(**sp, min_tokens=3), use_tqdm=False)[0]
    c = out.outputs[0]
    assert (c.token_ids, c.text, c.finish_reason) == ([paris] * 3, " Paris Paris", "stop")
