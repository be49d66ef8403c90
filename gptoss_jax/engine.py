"""The serving engine: requests in, tokens out, one scheduler + device step at a time.

`Engine.step()` asks the scheduler for this step's work (prefill chunks and decoding sequences) and
dispatches one compiled prefill call and one compiled (multi-step) decode call. With async
scheduling (the default) it then reads the *previous* step's sampled tokens while the new calls
run: decode inputs come from an on-device last-token table, so the device never waits for the
host's bookkeeping. Reading a step's tokens appends them, applies stop tokens, stop strings and
length limits, and reports what each request gained. The offline `LLM` API and the server's
`AsyncEngine` both drive this loop. Design notes: docs/engine.md.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import warnings
from pathlib import Path
from typing import Any, Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import pallas_kernels
from sharding.rules import make_layout

from gptoss_jax import checkpoint, demo, engine_config, kv_cache, runtime, steps, tokenizer as tokenizer_lib
from gptoss_jax import model as model_lib
from gptoss_jax.config import ModelConfig
from gptoss_jax.engine_config import EngineConfig, bucket
from pallas_kernels.params import Params
from gptoss_jax.sampling import SamplingParams, find_stop_string
from gptoss_jax.scheduler import PrefillChunk, Scheduler, Sequence

log = logging.getLogger(__name__)
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
CPU_KV_BYTES = 64 << 20  # devices without memory statistics (CPU) get this much KV cache
# CPU and some backends cannot reuse donated buffers; that only costs a copy.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")


@dataclasses.dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None         # "stop" | "length" | "abort"
    stop_reason: int | str | None     # the stop token id (not in the output) or stop string
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None
    num_prompt_tokens: int
    num_cached_prompt_tokens: int


@dataclasses.dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of full-layer pages held by requests
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_compiles: int      # process-wide compiled step programs


@dataclasses.dataclass
class _Call:
    """A dispatched step whose sampled tokens the host has not read yet. Entries carry the sequence's
    epoch at dispatch: a sequence that left the batch since (finished, aborted, preempted) is skipped."""
    prefills: list[tuple[Sequence, int, int, bool]]  # sequence, row, epoch, chunk ends the prompt
    decodes: list[tuple[Sequence, int, int]]          # sequence, row, epoch
    prefill_out: steps.Sampled | None
    decode_out: steps.Sampled | None


class Engine:
    """Continuous-batching engine over a paged KV cache. `model=None` loads the built-in demo checkpoint;
    `loaded=(model_config, params)` uses parameters already on device. `config` is an `EngineConfig`, a
    YAML path or a profile name ('low_latency', 'max_throughput'); `overrides` replace its fields."""

    def __init__(self, model: str | os.PathLike | None = None, *, dtype: str = "bfloat16",
                 config: EngineConfig | str | os.PathLike | None = None, tokenizer: Any = None,
                 impl: str | None = None, seed: int = 0, loaded: tuple[ModelConfig, Params] | None = None,
                 cache_dir: str | os.PathLike | None = None, progress: bool = True, layout=None,
                 **overrides: Any):
        runtime.prepare()
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}: choose one of {sorted(DTYPES)}")
        self.config = ec = engine_config.load(config, **overrides)
        # Which kernels run (`pallas_kernels.choice`), resolved for this device; `impl` overrides the config's.
        self.kernels = (ec.kernels if impl is None else dataclasses.replace(ec.kernels, impl=impl)).for_device()
        # Several devices: `layout` (a sharding.rules.Layout) or the config's mesh; None = one device.
        if layout is None and ec.model_parallel * ec.replicas > 1:
            layout = make_layout(ec.model_parallel, ec.replicas, ec.parallel_mode, dispatch=ec.expert_dispatch)
        self.layout = layout
        self.num_ranks = layout.num_ranks if layout is not None else 1
        if loaded is None:
            self.model_path: Path | None = Path(model) if model is not None else demo.checkpoint_path()
            if layout is not None and cache_dir is None:  # each device reads only its slice, experts padded
                self.model_config, self.params = checkpoint.load_params_sharded(self.model_path, DTYPES[dtype],
                                                                                layout, progress=progress)
            else:
                self.model_config, self.params = checkpoint.load(self.model_path, DTYPES[dtype], impl=self.kernels.impl,
                                                                 cache_dir=cache_dir, progress=progress)
                if layout is not None:
                    self.params = layout.shard_params(self.params, self.model_config.num_kv_heads)
        else:
            self.model_path = Path(model) if model is not None else None
            self.model_config, self.params = loaded
            if layout is not None:
                self.params = layout.shard_params(self.params, self.model_config.num_kv_heads)
        self.params = pallas_kernels.prepare_params(self.params, self.kernels)  # sharded: each device its experts
        self.dtype = self.params.embed.dtype
        self.tokenizer = tokenizer
        if isinstance(tokenizer, (str, os.PathLike)) or (
                tokenizer is None and self.model_config.vocab_size == tokenizer_lib.VOCAB_SIZE):
            self.tokenizer = tokenizer_lib.load(tokenizer, self.model_path)

        mc, ec = self.model_config, self.config
        kv_bytes = None
        if ec.num_pages is None and ec.kv_cache_tokens is None:
            stats = jax.devices()[0].memory_stats() or {}
            if "bytes_limit" in stats:
                kv_bytes = int((stats["bytes_limit"] - stats.get("bytes_in_use", 0)) * ec.kv_cache_memory_fraction)
            else:
                kv_bytes = CPU_KV_BYTES
        full_tokens = ec.kv_cache_tokens if ec.num_pages is None else (ec.num_pages - 1) * ec.page_size
        n_full, n_sliding = kv_cache.pool_sizes(
            mc.num_layers, mc.num_kv_heads, mc.head_dim, jnp.dtype(self.dtype).itemsize, mc.sliding_window,
            ec.page_size, ec.max_num_seqs, max(ec.prefill_chunk_size, ec.decode_steps_per_call), kv_bytes,
            full_tokens)
        kv_args = (n_full, n_sliding, ec.page_size, mc.sliding_window, (mc.num_layers + 1) // 2,
                   ec.enable_prefix_caching)
        self.kv = (kv_cache.KVCacheManager(*kv_args) if self.num_ranks == 1
                   else kv_cache.RankedKVCacheManager(self.num_ranks, *kv_args))
        limit = ec.max_model_len or mc.max_position_embeddings
        if ec.max_model_len and ec.max_model_len > self.kv.capacity_tokens:
            raise ValueError(f"max_model_len={ec.max_model_len} exceeds the KV cache capacity of "
                             f"{self.kv.capacity_tokens} tokens ({n_full - 1} pages of {ec.page_size})")
        self.max_model_len = min(limit, self.kv.capacity_tokens)
        R = self.num_ranks  # each attention rank owns `n` consecutive pages of each pool
        # The cache and the last-token table are committed to their devices from the start. A step's outputs
        # are committed whenever an input is (parameters the caller placed, say), so an uncommitted first
        # cache would make warm-up compile programs that real calls then compile again.
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        self.cache = jax.jit(lambda: model_lib.PagedKVCache.zeros(mc, R * n_sliding, R * n_full, ec.page_size,
                                                                  self.dtype),
                             out_shardings=one if layout is None else layout.cache_sharding(mc.num_kv_heads))()
        self.scheduler = Scheduler(ec, self.kv)
        # Last sampled token per sequence slot; the extra slot takes padding rows' writes.
        self._spare_slot = ec.max_num_seqs
        last = np.zeros(ec.max_num_seqs + 1, np.int32)
        self._last_tokens = jax.device_put(last, one if layout is None else layout.named(P()))
        self._in_flight: _Call | None = None
        self.num_top = max(1, ec.max_logprobs)
        self._ctx_buckets = ec.context_buckets(self.max_model_len)
        self._requests: dict[str, Sequence] = {}
        self._aborted: list[StepOutput] = []
        self._rng = np.random.default_rng(seed)
        self._prompt_tokens = self._generation_tokens = 0
        log.info("KV cache: %d full-layer pages, %d sliding pages of %d tokens; max_model_len %d",
                 n_full, n_sliding, ec.page_size, self.max_model_len)
        if ec.warmup:
            self.warmup()

    # ---- requests --------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Seq[int], sampling_params: SamplingParams) -> None:
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params is {type(sampling_params).__name__}, expected SamplingParams")
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError(f"request {request_id}: empty prompt")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"request {request_id}: token id {bad[0]} is outside the vocabulary "
                             f"[0, {self.model_config.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"request {request_id}: prompt has {len(ids)} tokens; the context limit is "
                             f"{self.max_model_len} (max_model_len) including at least one generated token")
        sp = sampling_params
        if sp.logprobs is not None and sp.logprobs > self.config.max_logprobs:
            raise ValueError(f"SamplingParams.logprobs={sp.logprobs}: at most max_logprobs="
                             f"{self.config.max_logprobs} are served")
        if sp.stop and self.tokenizer is None:
            raise ValueError(f"SamplingParams.stop={list(sp.stop)!r}: stop strings need a tokenizer, and this "
                             "model has none (use stop_token_ids)")
        seed = sp.seed if sp.seed is not None else int(self._rng.integers(2**31))
        key = ((seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF)
        seq = Sequence(request_id, ids, len(ids), sp, key, min(len(ids) + sp.max_tokens, self.max_model_len))
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        self._prompt_tokens += len(ids)

    def abort_request(self, request_id: str) -> None:
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return
        self.scheduler.remove(seq)
        self._aborted.append(StepOutput(request_id, [], True, "abort", None, None, seq.num_prompt_tokens,
                                        seq.num_cached_prompt_tokens))

    def close(self) -> None:
        """Free the KV cache's device memory now (a new engine in the same process sizes its cache from
        free memory, so it must not wait for garbage collection)."""
        for buf in jax.tree.leaves((self.cache, self._last_tokens)):
            buf.delete()

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._aborted)

    def stats(self) -> EngineStats:
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), self.kv.usage(),
                           self.scheduler.num_preemptions, self._prompt_tokens, self._generation_tokens,
                           sum(steps.TRACES.values()))

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        outputs, self._aborted = self._aborted, []
        work = self.scheduler.schedule()
        call = None if work.empty else self._launch(work)
        if self._in_flight is not None:  # read while `call` runs on the device
            outputs += self._collect(self._in_flight)
        self._in_flight = None
        if call is not None:
            if self.config.async_scheduling:
                self._in_flight = call
            else:
                outputs += self._collect(call)
        return outputs

    def _launch(self, work) -> _Call:
        """Enqueue this step's prefill and decode calls (neither waits for the other)."""
        pre = self._dispatch_prefill(work.prefills) if work.prefills else (None, [])
        dec = self._dispatch_decode(work.decodes) if work.decodes else (None, [])
        call = _Call([(c.seq, row, c.seq.epoch, c.start + c.num_tokens == len(c.seq.token_ids))
                      for row, c in zip(pre[1], work.prefills)],
                     [(seq, row, seq.epoch) for row, seq in zip(dec[1], work.decodes)], pre[0], dec[0])
        self.scheduler.launched(work)
        return call

    def _collect(self, call: _Call) -> list[StepOutput]:
        """Wait for a call's tokens and hand them to their sequences."""
        outputs = []
        if call.prefills:
            sampled = _to_host(call.prefill_out, any(s.params.logprobs is not None for s, *_ in call.prefills))
            for seq, row, epoch, ends_prompt in call.prefills:
                if ends_prompt and seq.epoch == epoch:
                    seq.num_pending -= 1
                    outputs.append(self._append(seq, [_pick(sampled, (row,))]))
        if call.decodes:
            sampled = _to_host(call.decode_out, any(s.params.logprobs is not None for s, *_ in call.decodes))
            K = sampled[0].shape[0]
            for seq, row, epoch in call.decodes:
                if seq.epoch == epoch:
                    seq.num_pending -= K
                    outputs.append(self._append(seq, [_pick(sampled, (k, row)) for k in range(K)]))
        return outputs

    def _append(self, seq: Sequence, picks: list[tuple[int, float, list[tuple[int, float]]]]) -> StepOutput:
        """Add sampled tokens (fed one after another on device) until a stop or length limit."""
        sp = seq.params
        new, lps, reason, stop_reason = [], [], None, None
        for tok, lp, top in picks:
            if tok in sp.stop_token_ids:
                reason, stop_reason = "stop", tok
                break
            seq.token_ids.append(tok)
            new.append(tok)
            lps.append((lp, top[:sp.logprobs]))
            if sp.stop:
                stop_reason = self._stop_string(seq, tok)
                if stop_reason is not None:
                    reason = "stop"
                    break
            if len(seq.token_ids) >= seq.max_len:
                reason = "length"
                break
        self._generation_tokens += len(new)
        if reason is None:
            self.kv.register(seq.pages, seq.token_ids, seq.num_computed)  # pages its new tokens completed
        else:
            self.scheduler.remove(seq)
            del self._requests[seq.request_id]
        return StepOutput(seq.request_id, new, reason is not None, reason, stop_reason,
                          lps if sp.logprobs is not None else None, seq.num_prompt_tokens,
                          seq.num_cached_prompt_tokens)

    def _stop_string(self, seq: Sequence, tok: int) -> str | None:
        before = len(seq.text_bytes.decode("utf-8", errors="replace"))
        seq.text_bytes += self.tokenizer.decode_single_token_bytes(tok)
        found = find_stop_string(seq.text_bytes.decode("utf-8", errors="replace"), seq.params.stop, before)
        return found[1] if found else None

    # ---- device calls ------------------------------------------------------------------------------
    def _rows(self, seqs: list[Sequence], buckets: tuple[int, ...]) -> tuple[int, list[int]]:
        """Padded row count and each sequence's row. Rows are rank-major: rank `r` owns rows
        `[r * rows/R, (r + 1) * rows/R)`, each rank's share padded to the same bucket."""
        if self.num_ranks == 1:
            return bucket(len(seqs), buckets), list(range(len(seqs)))
        counts, where = [0] * self.num_ranks, []
        for s in seqs:
            where.append((s.pages.rank, counts[s.pages.rank]))
            counts[s.pages.rank] += 1
        per = bucket(max(max(counts), 1), buckets)
        return self.num_ranks * per, [r * per + i for r, i in where]

    def _put(self, x: np.ndarray) -> jax.Array:
        """A host batch array onto the device(s): rows split over the attention ranks."""
        if self.layout is None:
            return jnp.asarray(x)
        return jax.device_put(x, self.layout.named(self.layout.batch_spec(x.ndim)))

    def _tables(self, seqs: list[Sequence], rows: int, width: int, row_of: list[int] | None = None
                ) -> model_lib.PageTables:
        sliding = np.zeros((rows, width), np.int32)
        full = np.zeros((rows, width), np.int32)
        cached = np.zeros((rows,), np.int32)
        for i, seq in zip(row_of or range(len(seqs)), seqs):
            s, f = seq.pages.sliding[:width], seq.pages.full[:width]
            sliding[i, :len(s)], full[i, :len(f)], cached[i] = s, f, seq.full_cached
        return model_lib.PageTables(self._put(sliding), self._put(full), self._put(cached))

    def _sampling(self, seqs: list[Sequence], rows: int, row_of: list[int] | None = None) -> steps.SamplingBatch:
        row_of = list(row_of or range(len(seqs)))
        temperature, top_p = np.zeros(rows, np.float32), np.ones(rows, np.float32)
        top_k, min_p = np.zeros(rows, np.int32), np.zeros(rows, np.float32)
        keys, want = np.zeros((rows, 2), np.uint32), np.zeros(rows, bool)
        for i, s in zip(row_of, seqs):
            p = s.params
            temperature[i], top_k[i], top_p[i], min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
            keys[i], want[i] = s.key, p.logprobs is not None
        return steps.SamplingBatch(*(self._put(a) for a in (temperature, top_k, top_p, min_p, keys, want)))

    def _width(self, end_positions: list[int]) -> int:
        pages = math.ceil(max(end_positions) / self.config.page_size)
        return bucket(min(pages, self._ctx_buckets[-1]), self._ctx_buckets)

    def _dispatch_prefill(self, chunks: list[PrefillChunk]) -> tuple[steps.Sampled, list[int]]:
        ec = self.config
        seqs = [c.seq for c in chunks]
        rows, row_of = self._rows(seqs, ec.prefill_row_buckets())
        T = bucket(max(c.num_tokens for c in chunks), ec.prefill_token_buckets())
        tokens = np.zeros((rows, T), np.int32)
        positions = np.full((rows, T), -1, np.int32)
        last = np.zeros((rows,), np.int32)
        for i, c in zip(row_of, chunks):
            tokens[i, :c.num_tokens] = c.seq.token_ids[c.start:c.start + c.num_tokens]
            positions[i, :c.num_tokens] = np.arange(c.start, c.start + c.num_tokens)
            last[i] = c.num_tokens - 1
        tables = self._tables(seqs, rows, self._width([c.start + c.num_tokens for c in chunks]), row_of)
        out, self.cache = steps.prefill(self.params, self.cache, self._put(tokens), self._put(positions), tables,
                                        self._put(last), self._sampling(seqs, rows, row_of), cfg=self.model_config,
                                        kernels=self.kernels, layout=self.layout, num_top=self.num_top)
        self._last_tokens = steps.store_tokens(self._last_tokens, self._slots(seqs, rows, row_of), out.tokens)
        return out, row_of

    def _slots(self, seqs: list[Sequence], rows: int, row_of: list[int]) -> jax.Array:
        slots = np.full((rows,), self._spare_slot, np.int32)
        for i, s in zip(row_of, seqs):
            slots[i] = s.slot
        return self._put(slots)

    def _dispatch_decode(self, seqs: list[Sequence]) -> tuple[steps.Sampled, list[int]]:
        K = self.config.decode_steps_per_call
        rows, row_of = self._rows(seqs, self.config.decode_buckets())
        first = [s.decode_span(K)[0] for s in seqs]
        positions = np.full((rows,), -1, np.int32)
        positions[row_of] = first
        host = np.zeros((rows,), np.int32)  # -1: the input token is still on the device
        host[row_of] = [-1 if s.num_pending else s.token_ids[-1] for s in seqs]
        tables = self._tables(seqs, rows, self._width([p + K for p in first]), row_of)
        slots = self._slots(seqs, rows, row_of)
        tokens = steps.load_tokens(self._last_tokens, slots, self._put(host))
        out, self.cache = steps.decode(self.params, self.cache, tokens, self._put(positions), tables,
                                       self._sampling(seqs, rows, row_of), cfg=self.model_config, kernels=self.kernels,
                                       layout=self.layout, num_steps=K, num_top=self.num_top)
        self._last_tokens = steps.store_tokens(self._last_tokens, slots, out.tokens)
        return out, row_of

    def warmup(self) -> None:
        """Compile every (batch, tokens, block-table width) bucket now, with all-padding inputs."""
        ec = self.config
        R, i32 = self.num_ranks, np.int32
        for width in self._ctx_buckets:
            for rows in (R * b for b in ec.decode_buckets()):
                tables, slots = self._tables([], rows, width), self._slots([], rows, [])
                tokens = steps.load_tokens(self._last_tokens, slots, self._put(np.zeros(rows, i32)))
                out, self.cache = steps.decode(
                    self.params, self.cache, tokens, self._put(np.full((rows,), -1, i32)), tables,
                    self._sampling([], rows), cfg=self.model_config, kernels=self.kernels, layout=self.layout,
                    num_steps=ec.decode_steps_per_call, num_top=self.num_top)
                self._last_tokens = steps.store_tokens(self._last_tokens, slots, out.tokens)
            for rows in (R * b for b in ec.prefill_row_buckets()):
                tables, slots = self._tables([], rows, width), self._slots([], rows, [])
                for T in ec.prefill_token_buckets():
                    out, self.cache = steps.prefill(
                        self.params, self.cache, self._put(np.zeros((rows, T), i32)),
                        self._put(np.full((rows, T), -1, i32)), tables, self._put(np.zeros((rows,), i32)),
                        self._sampling([], rows), cfg=self.model_config, kernels=self.kernels, layout=self.layout,
                        num_top=self.num_top)
                    self._last_tokens = steps.store_tokens(self._last_tokens, slots, out.tokens)
        jax.block_until_ready((self.cache, self._last_tokens))

    def run_prompt(self, token_ids: Seq[int], step_fn) -> list[tuple[Any, int]]:
        """Feed one prompt through the paged cache in prefill chunks, outside the scheduler: per chunk,
        `step_fn(params, cache, tokens_BT, positions_BT, tables) -> (result, cache)` with the prompt in row
        0. Returns `(result, chunk length)` per chunk; the pages are borrowed and returned."""
        ids = [int(t) for t in token_ids]
        ec, pages = self.config, kv_cache.SequencePages()
        probe = Sequence("", ids, len(ids), SamplingParams(), (0, 0), len(ids), pages)
        out = []
        try:
            for start in range(0, len(ids), ec.prefill_chunk_size):
                n = min(ec.prefill_chunk_size, len(ids) - start)
                if not self.kv.can_allocate(pages, start, start + n):
                    raise ValueError(f"prompt of {len(ids)} tokens does not fit in the free KV cache")
                self.kv.allocate(pages, start, start + n)
                T = bucket(n, ec.prefill_token_buckets())
                rows = self.num_ranks  # the probe is row 0 (rank 0); other ranks get one padding row
                tokens = np.zeros((rows, T), np.int32)
                positions = np.full((rows, T), -1, np.int32)
                tokens[0, :n], positions[0, :n] = ids[start:start + n], np.arange(start, start + n)
                result, self.cache = step_fn(self.params, self.cache, self._put(tokens), self._put(positions),
                                             self._tables([probe], rows, self._width([start + n])))
                out.append((result, n))
                self.kv.slide(pages, start + n)
        finally:
            self.kv.free(pages)
        return out

    def prompt_logits(self, token_ids: Seq[int]) -> np.ndarray:
        """Logits `[len, vocab]` (fp32) at every position of one prompt, computed through the paged cache
        in prefill chunks."""
        step = functools.partial(steps.prompt_logits, cfg=self.model_config, kernels=self.kernels, layout=self.layout)
        return np.concatenate([np.asarray(lg[0, :n], np.float32) for lg, n in self.run_prompt(token_ids, step)])


def _to_host(s: steps.Sampled, with_logprobs: bool) -> tuple[np.ndarray, ...]:
    if with_logprobs:
        return tuple(np.asarray(a) for a in (s.tokens, s.logprob, s.top_ids, s.top_lps))
    return (np.asarray(s.tokens),)


def _pick(sampled: tuple[np.ndarray, ...], index: tuple[int, ...]) -> tuple[int, float, list[tuple[int, float]]]:
    if len(sampled) == 1:
        return int(sampled[0][index]), 0.0, []
    tokens, lp, ids, vals = sampled
    return int(tokens[index]), float(lp[index]), [(int(i), float(v)) for i, v in zip(ids[index], vals[index])]
