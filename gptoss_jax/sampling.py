"""Sampling parameters and the batched on-device sampler (per-row temperature, top-k, top-p, min-p,
seed) with optional log-probabilities."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from gptoss_jax.tokenizer import ASSISTANT_STOPS


@dataclasses.dataclass
class SamplingParams:
    """vLLM-style sampling settings. `temperature=0` is greedy; `top_k=0` / `top_p=1` / `min_p=0`
    disable those filters; `seed=None` draws from the engine's generator. `stop` strings end the
    output (the text excludes them; needs a tokenizer); `logprobs=n` returns each new token's
    log-probability and the `n` most likely alternatives (0 = the sampled token's only)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] | list[int] = ASSISTANT_STOPS
    stop: tuple[str, ...] | list[str] | str | None = None
    logprobs: int | None = None

    def __post_init__(self):
        def bad(field, why):
            raise ValueError(f"SamplingParams.{field}={getattr(self, field)!r}: {why}")

        if not isinstance(self.temperature, (int, float)) or not np.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a finite number >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            bad("top_k", "must be an integer >= 0 (0 disables it)")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad("seed", "must be an integer or None")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if any(not isinstance(t, (int, np.integer)) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        if any(not isinstance(x, str) or not x for x in stop):
            bad("stop", "must be a string or a list of non-empty strings")
        self.stop = tuple(stop)
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or self.logprobs < 0):
            bad("logprobs", "must be an integer >= 0 or None")


def sample(logits_BV: jax.Array, keys_B: jax.Array, temperature_B: jax.Array, top_k_B: jax.Array,
           top_p_B: jax.Array, min_p_B: jax.Array) -> jax.Array:
    """One token per row. Rows with temperature 0 take the argmax; others sample after the filters.

    Each row has its own PRNG key, so a request's draws do not depend on its batch neighbours.
    """
    logits = logits_BV.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # The sort below costs a pass over the vocabulary per row; all-greedy batches skip it.
    return jax.lax.cond(jnp.any(temperature_B > 0),
                        lambda: _filtered_draw(logits, keys_B, temperature_B, top_k_B, top_p_B, min_p_B, greedy),
                        lambda: greedy)


# Candidates examined without a full sort. Every filter keeps a prefix of the tokens sorted by logit,
# so each is a threshold on the logit; only a top-k beyond this, or a top-p nucleus wider than it (a
# very flat distribution), needs the whole vocabulary sorted, and only batches containing such a row
# pay for it. Batches without a top-k or top-p row skip the candidates (min-p needs only the maximum).
TOP_CANDIDATES = 1024
DRAW_BLOCK = 1024  # the inverse-CDF draw finds a block of this many tokens, then the token inside it


def _filtered_draw(logits, keys_B, temperature_B, top_k_B, top_p_B, min_p_B, greedy):
    B, V = logits.shape
    temp = jnp.maximum(temperature_B, 1e-6)[:, None]
    scaled = logits / temp
    top0 = jnp.max(logits, axis=-1) / temp[:, 0]
    ranked = (temperature_B > 0) & (((top_k_B > 0) & (top_k_B < V)) | (top_p_B < 1))
    t = jax.lax.cond(jnp.any(ranked), lambda: _rank_threshold(logits, scaled, temp, top_k_B, top_p_B),
                     lambda: jnp.full((B,), -jnp.inf, scaled.dtype))
    t_min_p = jnp.where(min_p_B > 0, top0 + jnp.log(jnp.maximum(min_p_B, 1e-30)), -jnp.inf)
    threshold = jnp.minimum(jnp.maximum(t, t_min_p), top0)  # the most likely token always survives
    w = jnp.where(scaled >= threshold[:, None], jnp.exp(scaled - top0[:, None]), 0.0)
    drawn = _inverse_cdf(w, jax.vmap(lambda key: jax.random.uniform(key))(keys_B))
    drawn = jnp.where(w[jnp.arange(B), drawn] > 0, drawn, greedy)  # u landed on a zero-width edge
    return jnp.where(temperature_B > 0, drawn, greedy).astype(jnp.int32)


def _rank_threshold(logits, scaled, temp, top_k_B, top_p_B):
    """Per row, the smallest scaled logit the top-k and top-p filters keep (-inf: neither)."""
    V = logits.shape[-1]
    lse = jax.nn.logsumexp(scaled, axis=-1)
    # Temperature keeps each row's order, so take the candidates from the raw logits: XLA then keeps a
    # real top-k instead of lowering it (behind the division) to a full sort.
    top = jax.lax.top_k(logits, min(TOP_CANDIDATES, V))[0] / temp  # [B, C], descending
    C = top.shape[-1]
    k = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, V), V)

    def prefix_thresholds(sorted_desc):
        """Top-k and top-p thresholds from a descending prefix of the logits that covers both."""
        n = sorted_desc.shape[-1]
        t_k = jnp.where(k <= n, jnp.take_along_axis(sorted_desc, jnp.clip(k - 1, 0, n - 1)[:, None], -1)[:, 0],
                        -jnp.inf)
        p = jnp.exp(sorted_desc - lse[:, None])
        kept = jnp.sum(jnp.cumsum(p, axis=-1) - p < top_p_B[:, None], axis=-1)  # >= 1
        t_p = jnp.where(top_p_B < 1, jnp.take_along_axis(sorted_desc, (kept - 1)[:, None], -1)[:, 0], -jnp.inf)
        return jnp.maximum(t_k, t_p)

    covered = jnp.sum(jnp.exp(top - lse[:, None]), axis=-1)
    needs_full = ((k > C) & (k < V)) | ((top_p_B < 1) & (covered < top_p_B) & (k > C))
    return jax.lax.cond(jnp.any(needs_full), lambda: prefix_thresholds(jnp.sort(scaled, axis=-1)[:, ::-1]),
                        lambda: prefix_thresholds(top))


def _inverse_cdf(w_BV: jax.Array, u_B: jax.Array) -> jax.Array:
    """The token where the cumulative weight first exceeds `u * total`, per row. Two levels (block
    sums, then a cumulative sum inside one block) instead of a cumulative sum over the vocabulary,
    which XLA runs as many passes over `[B, V]`."""
    B, V = w_BV.shape
    nb = -(-V // DRAW_BLOCK)
    w = jnp.pad(w_BV, ((0, 0), (0, nb * DRAW_BLOCK - V))).reshape(B, nb, DRAW_BLOCK)
    cum_blocks = jnp.cumsum(jnp.sum(w, axis=-1), axis=-1)  # [B, nb]
    u = u_B * cum_blocks[:, -1]
    j = jnp.minimum(jnp.sum(cum_blocks <= u[:, None], axis=-1), nb - 1)
    before = jnp.where(j > 0, jnp.take_along_axis(cum_blocks, jnp.maximum(j - 1, 0)[:, None], -1)[:, 0], 0.0)
    inner = jnp.cumsum(jnp.take_along_axis(w, j[:, None, None], axis=1)[:, 0], axis=-1)  # [B, DRAW_BLOCK]
    i = jnp.minimum(jnp.sum(inner <= (u - before)[:, None], axis=-1), DRAW_BLOCK - 1)
    return jnp.minimum(j * DRAW_BLOCK + i, V - 1)


def logprobs(logits_BV: jax.Array, tokens_B: jax.Array, num_top: int
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probabilities of the model's own distribution (before temperature and filters): of the
    sampled tokens `[B]`, and the `num_top` most likely ids and values `[B, num_top]`."""
    lp = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens_B[:, None], axis=-1)[:, 0]
    top_vals, top_ids = jax.lax.top_k(lp, num_top)
    return chosen, top_ids.astype(jnp.int32), top_vals


def find_stop_string(text: str, stops: tuple[str, ...], start: int = 0) -> tuple[int, str] | None:
    """Earliest stop string in `text` ending at or after `start`: `(index where it begins, stop)`."""
    best = None
    for stop in stops:
        i = text.find(stop, max(0, start - len(stop) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    return best
