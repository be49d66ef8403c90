"""Offline generation API, vLLM-style: `LLM(model=PATH).generate(prompts, SamplingParams(...))`.

Prompts run as one padded batch: a jitted prefill writes the KV cache, then a jitted decode step
(cache donated, so updated in place) produces one token per sequence per call. Shapes are bucketed
to powers of two so repeated calls reuse compiled steps.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from gptoss_jax import checkpoint, demo, model, tokenizer as tokenizer_lib
from gptoss_jax.config import ModelConfig
from gptoss_jax.sampling import SamplingParams, sample

log = logging.getLogger(__name__)
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str | None
    token_ids: list[int]
    finish_reason: str          # "stop" (a stop token was sampled) or "length"
    stop_reason: int | None     # the stop token id, not included in `token_ids`


@dataclasses.dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


def _bucket(n: int, minimum: int) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("cfg", "impl"), donate_argnames=("cache",))
def prefill_step(params, cache, tokens_BT, lengths_B, cfg: ModelConfig, impl: str):
    positions = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
    x, cache = model.forward(params, cache, tokens_BT, positions, cfg, impl)
    last = jnp.take_along_axis(x, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
    return model.unembed(params, last), cache


@functools.partial(jax.jit, static_argnames=("cfg", "impl"), donate_argnames=("cache",))
def decode_step(params, cache, tokens_B, positions_B, keys_B, temperature_B, top_k_B, top_p_B, min_p_B,
            cfg: ModelConfig, impl: str):
    x, cache = model.forward(params, cache, tokens_B[:, None], positions_B[:, None], cfg, impl)
    logits = model.unembed(params, x[:, 0])
    keys = jax.vmap(jax.random.fold_in)(keys_B, positions_B)
    return sample(logits, keys, temperature_B, top_k_B, top_p_B, min_p_B), cache


@functools.partial(jax.jit, static_argnames=("cfg", "impl"))
def _all_logits(params, tokens_BT, cfg: ModelConfig, impl: str):
    cache = model.KVCache.zeros(cfg, tokens_BT.shape[0], tokens_BT.shape[1], params.embed.dtype)
    positions = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
    x, _ = model.forward(params, cache, tokens_BT, positions, cfg, impl)
    return model.unembed(params, x)


class LLM:
    """A loaded gpt-oss model. `model=None` uses the built-in tiny demo checkpoint."""

    def __init__(self, model: str | os.PathLike | None = None, dtype: str = "bfloat16", *,
                 tokenizer: str | os.PathLike | None = None, max_model_len: int | None = None,
                 cache_dir: str | os.PathLike | None = None, impl: str = "reference", seed: int = 0,
                 progress: bool = True):
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}: choose one of {sorted(DTYPES)}")
        self.model_path = Path(model) if model is not None else demo.checkpoint_path()
        self.dtype = DTYPES[dtype]
        self.impl = impl
        self.config, self.params = checkpoint.load(self.model_path, self.dtype, cache_dir=cache_dir,
                                                   progress=progress)
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        # Only a model with the real vocabulary can use the real tokenizer; tiny test models take ids.
        self.tokenizer = None
        if self.config.vocab_size == tokenizer_lib.VOCAB_SIZE or tokenizer is not None:
            self.tokenizer = tokenizer_lib.load(tokenizer, self.model_path)
        self._rng = np.random.default_rng(seed)

    # ---- helpers -------------------------------------------------------------------------------
    def _encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"{self.model_path} has a {self.config.vocab_size}-token vocabulary, not "
                             "o200k_harmony's: pass prompt_token_ids instead of text prompts")
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
            raise ValueError(f"{where}: prompt has {len(ids)} tokens; the context limit is "
                             f"{self.max_model_len} (max_model_len) including at least one generated token")
        return ids

    # ---- public API ----------------------------------------------------------------------------
    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Prefill logits `[len, vocab]` (float32) for every position of one token sequence."""
        ids = self._check_ids(token_ids, "logits")
        T = _bucket(len(ids), 16)
        tokens = np.zeros((1, T), np.int32)
        tokens[0, :len(ids)] = ids
        out = _all_logits(self.params, jnp.asarray(tokens), self.config, self.impl)
        return np.asarray(out[0, :len(ids)], np.float32)

    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None, use_tqdm: bool = True
                 ) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in order. Give text `prompts` or `prompt_token_ids`."""
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompts or prompt_token_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        texts = list(prompts) if prompts is not None else [None] * len(prompt_token_ids)
        ids = ([self._check_ids(self._encode(p), f"prompt {i}") for i, p in enumerate(texts)] if prompts is not None
               else [self._check_ids(p, f"prompt_token_ids[{i}]") for i, p in enumerate(prompt_token_ids)])
        if not ids:
            return []
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = [params] * len(ids) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(ids):
            raise ValueError(f"got {len(params)} SamplingParams for {len(ids)} prompts")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params[{i}] is {type(p).__name__}, expected SamplingParams")
        outs = self._run_batch(ids, params, use_tqdm)
        return [RequestOutput(t, i, [o]) for t, i, o in zip(texts, ids, outs)]

    def _run_batch(self, ids: list[list[int]], params: list[SamplingParams], use_tqdm: bool):
        n = len(ids)
        B = _bucket(n, 1)
        lengths = np.array([len(x) for x in ids] + [1] * (B - n), np.int32)
        budgets = [min(p.max_tokens, self.max_model_len - len(x)) for p, x in zip(params, ids)]
        T = _bucket(int(lengths.max()), 16)
        S = _bucket(max(len(x) + b for x, b in zip(ids, budgets)), 16)
        S = max(S, T)
        tokens = np.zeros((B, T), np.int32)
        for i, x in enumerate(ids):
            tokens[i, :len(x)] = x
        pad = [SamplingParams(temperature=0.0)] * (B - n)
        allp = params + pad
        temperature = jnp.asarray([p.temperature for p in allp], jnp.float32)
        top_k = jnp.asarray([p.top_k for p in allp], jnp.int32)
        top_p = jnp.asarray([p.top_p for p in allp], jnp.float32)
        min_p = jnp.asarray([p.min_p for p in allp], jnp.float32)
        seeds = [p.seed if p.seed is not None else int(self._rng.integers(2**31)) for p in allp]
        keys = jnp.stack([jax.random.PRNGKey(s) for s in seeds])

        cache = model.KVCache.zeros(self.config, B, S, self.dtype)
        logits, cache = prefill_step(self.params, cache, jnp.asarray(tokens), jnp.asarray(lengths), self.config,
                                 self.impl)
        first_keys = jax.vmap(jax.random.fold_in)(keys, jnp.asarray(lengths - 1))
        next_tok = np.asarray(sample(logits, first_keys, temperature, top_k, top_p, min_p))

        generated: list[list[int]] = [[] for _ in range(n)]
        finish: list[tuple[str, int | None] | None] = [None] * n
        positions = lengths.copy()
        bar = tqdm(total=sum(budgets), desc="Generating", unit="tok", disable=not use_tqdm)
        while True:
            for i in range(n):
                if finish[i] is not None:
                    continue
                tok = int(next_tok[i])
                if tok in params[i].stop_token_ids:
                    finish[i] = ("stop", tok)
                    bar.update(budgets[i] - len(generated[i]))
                    continue
                generated[i].append(tok)
                bar.update(1)
                if len(generated[i]) >= budgets[i]:
                    finish[i] = ("length", None)
            if all(f is not None for f in finish):
                break
            next_tok, cache = decode_step(self.params, cache, jnp.asarray(next_tok), jnp.asarray(positions), keys,
                                      temperature, top_k, top_p, min_p, self.config, self.impl)
            next_tok = np.asarray(next_tok)
            positions = np.minimum(positions + 1, S - 1)
        bar.close()
        return [CompletionOutput(0, self._decode_text(g), g, f[0], f[1]) for g, f in zip(generated, finish)]
