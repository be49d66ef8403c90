"""Offline generation API, vLLM-style: `LLM(model=PATH).generate(prompts, SamplingParams(...))`.

A thin synchronous loop over the serving `Engine` (paged KV cache, continuous batching, chunked
prefill, compiled steps): every prompt becomes a request and `generate` steps the engine until all
are done, so offline and online generation share one path.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from gptoss_jax import inspection
from gptoss_jax.config import ModelConfig
from gptoss_jax.engine import DTYPES, Engine
from gptoss_jax.engine_config import EngineConfig
from gptoss_jax.inspection import Inspection
from gptoss_jax.sampling import SamplingParams, find_stop_string
from pallas_kernels.params import Params


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str | None
    token_ids: list[int]
    finish_reason: str  # "stop" (a stop token or string), "length", or "error" (the engine failed it: see `error`)
    stop_reason: int | str | None  # the stop token id (not in `token_ids`) or the stop string (not in `text`)
    logprobs: list | None = None  # per token: (logprob, [(token_id, logprob), ...])
    # `LLM.chat` only, as the server splits a harmony reply: `text` is the final answer (the `content`), the
    # analysis channel is `reasoning_content`, and `functions.*` calls are `tool_calls` ({"name", "arguments"}).
    reasoning_content: str | None = None
    tool_calls: list[dict] | None = None
    error: str | None = None  # why the engine failed this request (finish_reason "error"); the others are unaffected
    cumulative_logprob: float | None = None  # the sum of `logprobs` (the model's own); set with logprobs or best_of


@dataclasses.dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0


class LLM:
    """A loaded gpt-oss model. `model` is a checkpoint folder or a Hugging Face repo id (`revision`, `download_dir`
    as vLLM's); None uses the built-in tiny demo checkpoint. `close()` (or leaving a `with LLM(...) as llm:` block,
    or dropping the last reference) frees its device memory."""

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        dtype: str = "bfloat16",
        *,
        tokenizer: str | os.PathLike | None = None,
        max_model_len: int | None = None,
        cache_dir: str | os.PathLike | None = None,
        compile_cache_dir: str | os.PathLike | bool | None = None,
        impl: str | None = None,
        seed: int = 0,
        progress: bool = True,
        engine_config: EngineConfig | str | None = None,
        revision: str | None = None,
        download_dir: str | os.PathLike | None = None,
        **engine_overrides,
    ):
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}: choose one of {sorted(DTYPES)}")
        if max_model_len is not None:
            engine_overrides["max_model_len"] = max_model_len
        self.engine = Engine(
            model,
            dtype=dtype,
            config=engine_config,
            tokenizer=tokenizer,
            impl=impl,
            seed=seed,
            cache_dir=cache_dir,
            compile_cache_dir=compile_cache_dir,
            progress=progress,
            revision=revision,
            download_dir=download_dir,
            **engine_overrides,
        )
        self.model_path = self.engine.model_path
        self.config = self.engine.model_config
        self.params = self.engine.params
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self._next_id = 0
        self._renderer = None

    def close(self) -> None:
        """Free the device memory now (KV cache, parameters); the object is unusable afterwards."""
        self.engine.close()
        self.params = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @classmethod
    def from_params(
        cls, config: ModelConfig, params: Params, *, model: str | os.PathLike | None = None, layout=None, **kwargs
    ) -> LLM:
        """An `LLM` over parameters already in memory (e.g. `gptoss_jax.nnx.GptOss.to_llm`), shared with the caller,
        not copied. `model`: the checkpoint folder they came from (where the tokenizer is looked for); `layout`: the
        `sharding.rules.Layout` they are placed by; `kwargs`: as for `LLM`. The dtype is the parameters'."""
        dtype = jnp.dtype(params.embed.dtype).name
        return cls(model, dtype, loaded=(config, params), layout=layout, **kwargs)

    # ---- helpers -------------------------------------------------------------------------------
    def _encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(
                f"{self.model_path} has a {self.config.vocab_size}-token vocabulary, not "
                "o200k_harmony's: pass prompt_token_ids instead of text prompts"
            )
        return self.tokenizer.encode(prompt, allowed_special="all")

    def _decode_text(self, ids: list[int]) -> str | None:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else None

    def _check_ids(self, ids: Sequence[int], where: str) -> list[int]:
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError(f"{where}: empty prompt")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"{where}: token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"{where}: prompt has {len(ids)} tokens; the context limit is "
                f"{self.max_model_len} (max_model_len) including at least one generated token"
            )
        return ids

    # ---- public API ----------------------------------------------------------------------------
    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Prefill logits `[len, vocab]` (float32) for every position of one token sequence."""
        return self.engine.prompt_logits(self._check_ids(token_ids, "logits"))

    def inspect(self, token_ids: Sequence[int], hidden_states: bool = False, logits: bool = False) -> Inspection:
        """Per-layer internals for one token sequence: router logits, chosen experts and weights, the
        attention mass each head gives its sink, optionally the residual stream after each layer and the
        logits. Same jitted model code, kernels and paged path as `logits`, with `model.Inspect` on; see
        `gptoss_jax.inspection`."""
        return inspection.run(
            self.engine, self._check_ids(token_ids, "inspect"), hidden_states=hidden_states, logits=logits
        )

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in order. Give text `prompts` or `prompt_token_ids`."""
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompts or prompt_token_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        texts = list(prompts) if prompts is not None else [None] * len(prompt_token_ids)
        ids = (
            [self._check_ids(self._encode(p), f"prompt {i}") for i, p in enumerate(texts)]
            if prompts is not None
            else [self._check_ids(p, f"prompt_token_ids[{i}]") for i, p in enumerate(prompt_token_ids)]
        )
        if not ids:
            return []
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = [params] * len(ids) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(ids):
            raise ValueError(f"got {len(params)} SamplingParams for {len(ids)} prompts")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params[{i}] is {type(p).__name__}, expected SamplingParams")
        # n (or best_of) completions of a prompt are as many requests (completion j seeded `seed + j`), run in one
        # batch; with best_of the n of highest cumulative log-probability are kept, in that order (vLLM's)
        flat = [(k, j) for k, p in enumerate(params) for j in range(p.best_of or p.n)]
        one = [
            dataclasses.replace(
                params[k],
                n=1,
                best_of=None,
                seed=None if params[k].seed is None else params[k].seed + j,
                logprobs=0 if params[k].best_of and params[k].logprobs is None else params[k].logprobs,
            )
            for k, j in flat
        ]
        outs = self._run_batch([ids[k] for k, _ in flat], one, use_tqdm)
        results = [RequestOutput(t, i, [], 0) for t, i in zip(texts, ids)]
        for (k, j), (o, cached) in zip(flat, outs):
            o.index = j
            if o.logprobs is not None:
                o.cumulative_logprob = float(sum(lp for lp, _ in o.logprobs))
            results[k].outputs.append(o)
            results[k].num_cached_tokens = cached
        for k, p in enumerate(params):
            if p.best_of:
                best = sorted(results[k].outputs, key=lambda o: -o.cumulative_logprob)[: p.n]
                for j, o in enumerate(best):
                    o.index = j
                    if p.logprobs is None:
                        o.logprobs = None
                results[k].outputs = best
        return results

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        reasoning_effort: str = "medium",
        tools: list[dict] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Chat completions offline: each conversation (OpenAI-style `messages`, or a list of them) rendered with
        harmony as the server renders it (`reasoning_effort`, function `tools`), generated, and its reply split as
        the server splits it: `text` the final answer, `reasoning_content` the analysis, `tool_calls` the calls.
        Needs the `serve` extra (openai-harmony) and the o200k_harmony vocabulary."""
        from gptoss_jax import harmony

        if self.tokenizer is None:
            raise ValueError(f"{self.model_path} has no o200k_harmony vocabulary: chat needs one")
        if self._renderer is None:
            self._renderer = harmony.Renderer()
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        effort = harmony.parse_reasoning_effort(("reasoning_effort", reasoning_effort))
        parsed_tools = harmony.parse_chat_tools(tools, None) if tools else []
        prompts = [self._renderer.render_chat(m, parsed_tools, effort) for m in conversations]
        if sampling_params is None:
            sampling_params = SamplingParams(stop_token_ids=harmony.STOP_TOKENS)
        outs = self.generate(prompt_token_ids=prompts, sampling_params=sampling_params, use_tqdm=use_tqdm)
        for out in outs:
            out.prompt = None
            for c in out.outputs:
                self._split_reply(c, harmony.OutputParser(self.tokenizer, [t.name for t in parsed_tools]))
        return outs

    @staticmethod
    def _split_reply(c: CompletionOutput, parser) -> None:
        """Harmony reply tokens -> content, reasoning and tool calls (the server's parser)."""
        deltas = [d for t in c.token_ids for d in parser.process(t)] + parser.finish()
        content, reasoning, calls = [], [], {}
        for d in deltas:
            if d.kind == "content":
                content.append(d.text)
            elif d.kind == "reasoning":
                reasoning.append(d.text)
            elif d.kind == "tool_start":
                calls[d.tool_index] = {"name": d.name, "arguments": ""}
            elif d.kind == "tool_args":
                calls[d.tool_index]["arguments"] += d.text
        c.text = "".join(content)
        c.reasoning_content = "".join(reasoning) or None
        c.tool_calls = [calls[i] for i in sorted(calls)] or None
        if c.tool_calls and c.finish_reason == "stop":
            c.finish_reason = "tool_calls"

    def _run_batch(
        self, ids: list[list[int]], params: list[SamplingParams], use_tqdm: bool
    ) -> list[tuple[CompletionOutput, int]]:
        rids = [f"llm-{self._next_id + i}" for i in range(len(ids))]
        self._next_id += len(ids)
        tokens: dict[str, list[int]] = {r: [] for r in rids}
        logprobs: dict[str, list] = {r: [] for r in rids}
        done: dict[str, tuple] = {}
        try:
            for r, x, p in zip(rids, ids, params):
                self.engine.add_request(r, x, p)
            with tqdm(total=len(rids), desc="Generating", unit="req", disable=not use_tqdm) as bar:
                while len(done) < len(rids):
                    for out in self.engine.step():
                        tokens[out.request_id] += out.new_token_ids
                        logprobs[out.request_id] += out.logprobs or []
                        if out.finished:
                            done[out.request_id] = (
                                out.finish_reason,
                                out.stop_reason,
                                out.num_cached_prompt_tokens,
                                out.error,
                            )
                            bar.update(1)
        finally:
            for r in rids:
                if r not in done:
                    self.engine.abort_request(r)
            while self.engine.has_unfinished_requests():  # drain abort notices
                self.engine.step()
        outs = []
        for r, x, p in zip(rids, ids, params):
            reason, stop_reason, cached, error = done[r]
            text = self._decode_text(tokens[r])
            if isinstance(stop_reason, str) and text is not None:  # it ends in the last token (min_tokens: not before)
                last = len(self._decode_text(tokens[r][:-1])) if p.min_tokens else 0
                text = text[: find_stop_string(text, (stop_reason,), last)[0]]
            outs.append(
                (
                    CompletionOutput(
                        0,
                        text,
                        tokens[r],
                        reason,
                        stop_reason,
                        logprobs[r] if p.logprobs is not None else None,
                        error=error,
                    ),
                    cached,
                )
            )
        return outs
