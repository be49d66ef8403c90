"""The model runner: everything of an engine that lives on the device, and the calls that reach it.

It owns the parameters, the paged KV cache (sized from the device's free memory) and the last-token table, packs
the scheduler's work into the fixed-shape batches of the compiled steps (rows, prompt tokens and block-table widths
rounded up to the engine config's buckets; under a layout rows are rank-major, each rank's share padded to the
same bucket) and dispatches them. Every call returns at once with device arrays (`Sampled`) that the engine reads
later, so the host schedules the next step while the device runs this one. Warm-up compiles every bucket through
the same dispatch code with all-padding batches.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from gptoss_jax import kv_cache, lowering, model, runtime, sampling, speculative, steps, structured, upload
from gptoss_jax.config import ModelConfig
from gptoss_jax.engine_config import EngineConfig, bucket, padded_rows
from gptoss_jax.program_store import ProgramStore
from gptoss_jax.sampling import Sampled, SamplerState, SamplingBatch
from gptoss_jax.scheduler import PrefillChunk, Sequence
from pallas_kernels import KernelConfig, kv_quant
from pallas_kernels.params import Params

log = logging.getLogger(__name__)
CPU_KV_BYTES = 64 << 20  # devices without memory statistics (CPU) get this much KV cache


class ModelRunner:
    """The device side of one engine: `model_config`'s `params` (already placed), `kernels` resolved for the
    device, an optional `layout` (`sharding.rules.Layout`), the engine `config`'s cache and bucket settings, and the
    `store` of compiled steps kept across processes."""

    def __init__(
        self,
        model_config: ModelConfig,
        params: Params,
        config: EngineConfig,
        kernels: KernelConfig,
        layout=None,
        store: ProgramStore | None = None,
    ):
        mc, ec = model_config, config
        self.model_config, self.params, self.config, self.layout = mc, params, ec, layout
        self.num_ranks = layout.num_ranks if layout is not None else 1
        self.dtype = params.embed.dtype
        self.kv_dtype = kv_quant.DTYPES[ec.kv_cache_dtype] or self.dtype  # the pools' (FP8: with scales)
        spec = ec.speculative_config
        cap = ec.max_model_len or mc.max_position_embeddings
        self.drafter = None if spec is None else speculative.make_drafter(spec, mc.vocab_size, cap, mc)
        # A drafter model reading the target's hidden states (EAGLE-3) also runs in prefill calls (`prefill_drafting`).
        self.prefill_drafts = bool(getattr(self.drafter, "aux_layers", ()))
        self.st = steps.StepConfig(
            mc, kernels, layout, num_top=max(1, ec.max_logprobs), num_steps=ec.decode_steps_per_call
        )
        # Decode's settings: with speculation, the drafter too (prefill's programs stay those without it, but for
        # `prefill_drafts`).
        self.st_decode = dataclasses.replace(self.st, drafter=self.drafter)
        # calls with more requests enqueued than `disable_by_batch_size`
        self.st_no_draft = dataclasses.replace(self.st_decode, draft=False)
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        # The logits processors' per-slot state (committed, as the cache below), allocated before the KV cache is
        # sized so that its memory is counted as in use (uint16 counts: 2 bytes x vocabulary per sequence slot).
        self._sampler_state = jax.jit(
            functools.partial(SamplerState.zeros, ec.max_num_seqs + 1, mc.vocab_size),
            out_shardings=one if layout is None else layout.named(P()),
        )()
        # The drafter's per-slot history (`speculative.DraftState`), with speculation only.
        self._draft_state = None
        if self.drafter is not None:
            self._draft_state = jax.jit(
                functools.partial(speculative.DraftState.empty, ec.max_num_seqs + 1, self.drafter.history_tokens),
                out_shardings=one,
            )()
        # The drafter's device arrays (a drafter model's weights; the oracle's acceptance length), else None.
        self.draft_params = None
        if hasattr(self.drafter, "params"):
            self.draft_params = jax.device_put(self.drafter.params(spec, params), one)
        self.num_pages_full, self.num_pages_sliding = self._pool_sizes()
        capacity = (self.num_pages_full - 1) * ec.page_size
        if ec.max_model_len and ec.max_model_len > capacity:
            raise ValueError(
                f"max_model_len={ec.max_model_len} exceeds the KV cache capacity of {capacity} tokens "
                f"({self.num_pages_full - 1} pages of {ec.page_size}; the sliding-window layers hold "
                f"{self.num_pages_sliding - 1} pages, the window and a decode call for each of max_num_seqs="
                f"{ec.max_num_seqs} and a prefill call of max_num_batched_tokens={ec.max_num_batched_tokens}): "
                "lower max_model_len or max_num_seqs, raise gpu_memory_utilization, or set kv_cache_dtype: fp8"
            )
        self.max_model_len = min(ec.max_model_len or mc.max_position_embeddings, capacity)
        self._ctx_buckets = ec.context_buckets(self.max_model_len)
        # The kernels' steps take the widest table always: their cost does not depend on the table's width (the
        # kernels visit only the pages a row's positions see, over a grid that the width does not change at the
        # default `min_context_bucket`), so one program per (rows, tokens) serves every context: a cold start at
        # 131,072 tokens compiles 29 programs instead of 56 (BENCHMARKS §14). The reference attention and the
        # EAGLE-3 drafter's gather the whole table: they keep the widths.
        one_width = kernels.impl == "pallas"
        self._prefill_widths = self._ctx_buckets[-1:] if one_width else self._ctx_buckets
        self._decode_widths = self._ctx_buckets[-1:] if one_width and not self.prefill_drafts else self._ctx_buckets
        self._programs: dict[tuple, Any] = {}  # bucket -> its compiled step (`_program`)
        self.lowered_in_workers = 0  # programs of the warm-ups so far that worker processes lowered
        # Per row count, the all-zero token mask of calls without a structured-output row: on the device once.
        self._no_mask: dict[int, tuple[jax.Array, ...]] = {}
        self._no_lists: dict[int, sampling.SamplingLists] = {}  # rows -> empty processor lists on the device
        self._no_fed: dict[int, jax.Array] = {}  # rows -> decode's host-fed inputs when no row has any (all -1)
        self.store = store or ProgramStore(None)
        self._devices = [jax.devices()[0]] if layout is None else list(layout.mesh.devices.flat)
        R, n_full, n_sliding = self.num_ranks, self.num_pages_full, self.num_pages_sliding
        # The cache and the last-token table are committed to their devices from the start. A step's outputs
        # are committed whenever an input is (parameters the caller placed, say), so an uncommitted first
        # cache would make warm-up compile programs that real calls then compile again.
        zeros = functools.partial(model.PagedKVCache.zeros, mc, R * n_sliding, R * n_full, ec.page_size, self.kv_dtype)
        self.cache = jax.jit(
            zeros,
            out_shardings=one if layout is None else layout.cache_shardings(jax.eval_shape(zeros), mc.num_kv_heads),
        )()
        # Last sampled token per sequence slot; the extra slot takes padding rows' writes.
        self._spare_slot = ec.max_num_seqs
        last = np.zeros(ec.max_num_seqs + 1, np.int32)
        self._last_tokens = jax.device_put(last, one if layout is None else layout.named(P()))
        if self.prefill_drafts:  # the drafter's paged K/V, page ids as the target's full layers
            extend = functools.partial(self.drafter.extend_state, num_pages=R * n_full, page_size=ec.page_size)
            self._draft_state = jax.jit(functools.partial(extend, dtype=self.dtype), out_shardings=one)(
                self._draft_state
            )
        log.info(
            "KV cache (%s): %d full-layer pages, %d sliding pages of %d tokens (%d tokens); max_model_len %d, so "
            "at most %.1f requests of that length at once (max_num_seqs %d)",
            jnp.dtype(self.kv_dtype).name,
            n_full,
            n_sliding,
            ec.page_size,
            capacity,
            self.max_model_len,
            capacity / self.max_model_len,
            ec.max_num_seqs,
        )

    @property
    def kernels(self) -> KernelConfig:
        return self.st.kernels

    def _pool_sizes(self) -> tuple[int, int]:
        """(full, sliding) pages per attention rank: the config's count, or what `gpu_memory_utilization` of the
        device leaves after the weights (in use now) and the activation reserve (`kv_cache.activation_bytes`)."""
        mc, ec = self.model_config, self.config
        kv_bytes = None
        if ec.num_pages is None and ec.kv_cache_tokens is None:
            stats = jax.devices()[0].memory_stats() or {}
            if "bytes_limit" in stats:
                kv_bytes = self._kv_budget(stats)
            else:
                kv_bytes = CPU_KV_BYTES
            if self.prefill_drafts:  # the drafter's pool has a page per full-layer page: its share of the budget
                d, value = self.drafter.cfg, kv_quant.value_bytes(self.kv_dtype, mc.head_dim)
                target = (mc.num_layers // 2) * mc.num_kv_heads * mc.head_dim * value  # per token, K or V
                draft = d.num_kv_heads * d.head_dim * jnp.dtype(self.dtype).itemsize
                kv_bytes = int(kv_bytes * target / (target + draft))
        full_tokens = ec.kv_cache_tokens if ec.num_pages is None else (ec.num_pages - 1) * ec.page_size
        return kv_cache.pool_sizes(
            mc.num_layers,
            mc.num_kv_heads,
            mc.head_dim,
            kv_quant.value_bytes(self.kv_dtype, mc.head_dim),
            kv_cache.engine_sliding_pages(ec, mc.sliding_window),
            ec.page_size,
            kv_bytes,
            full_tokens,
        )

    def _kv_budget(self, stats: dict) -> int:
        """KV cache bytes per device under vLLM's meaning of `gpu_memory_utilization`: that fraction of the whole
        device, less what is in use (the weights) and the reserve for the largest step's activations."""
        mc, ec = self.model_config, self.config
        total = runtime.device_memory_bytes(stats)
        allowed = ec.gpu_memory_utilization * total
        if allowed > stats["bytes_limit"]:
            log.warning(
                "gpu_memory_utilization=%.2f asks for %.1f GiB, JAX's memory pool has %.1f GiB "
                "(XLA_PYTHON_CLIENT_MEM_FRACTION): using the pool",
                ec.gpu_memory_utilization,
                allowed / 2**30,
                stats["bytes_limit"] / 2**30,
            )
            allowed = stats["bytes_limit"]
        in_use = stats.get("bytes_in_use", 0)
        # a bf16 copy of the experts (`KernelConfig.moe_prefill_bf16_experts`) is in use already, among the weights
        copy = getattr(self.params.layers.experts, "gu_bf16", None)
        stored = copy is not None
        reserve = kv_cache.activation_bytes(mc, ec, jnp.dtype(self.dtype).itemsize, dequantizes=not stored)
        kv = int(allowed - in_use - reserve)
        log.info(
            "memory: %.2f x %.1f GiB = %.1f GiB for this engine: %.1f GiB in use (weights), %.1f GiB reserved for "
            "activations, %.1f GiB for the KV cache",
            ec.gpu_memory_utilization,
            total / 2**30,
            allowed / 2**30,
            in_use / 2**30,
            reserve / 2**30,
            kv / 2**30,
        )
        if kv <= 0:
            of_which = ""
            if stored:  # a device's share: gate/up is 2 of its 3 bf16 values per expert weight
                share = 1.5 * math.prod(copy.sharding.shard_shape(copy.shape)) * copy.dtype.itemsize
                of_which = f" (of which the experts' bf16 copy, kernels.moe_prefill_bf16_experts, {share / 2**30:.1f})"
            raise ValueError(
                f"gpu_memory_utilization={ec.gpu_memory_utilization} of this device ({total / 2**30:.1f} GiB) is "
                f"{allowed / 2**30:.1f} GiB: the weights and other arrays already use {in_use / 2**30:.1f} GiB"
                f"{of_which} and the activations need ~{reserve / 2**30:.1f} GiB, which leaves nothing for the KV "
                "cache; raise gpu_memory_utilization, or lower max_num_batched_tokens / max_num_seqs"
                + (", or turn kernels.moe_prefill_bf16_experts off" if stored else "")
            )
        return kv

    def close(self, params: bool = False) -> None:
        """Free the KV cache's device memory now, and the parameters' with `params` (a new engine in the same
        process sizes its cache from the device's memory, so it must not wait for garbage collection)."""
        bufs = (self.cache, self._last_tokens, self._sampler_state, self._draft_state) + (
            (self.params,) if params else ()
        )
        for buf in jax.tree.leaves(bufs):
            if not buf.is_deleted():
                buf.delete()
        self._programs.clear()
        self._no_mask.clear()
        self._no_lists.clear()
        self._no_fed.clear()

    # ---- the steps ---------------------------------------------------------------------------------------------
    def prefill(self, chunks: list[PrefillChunk]) -> tuple[Sampled, list[int]]:
        """Dispatch one prefill call for `chunks` -> (its sampled tokens on device, each chunk's row)."""
        ec = self.config
        rows, row_of = self._rows([c.seq for c in chunks], ec.prefill_row_buckets())
        T = bucket(max(c.num_tokens for c in chunks), ec.prefill_token_buckets())
        width = self._width([c.start + c.num_tokens for c in chunks], self._prefill_widths)
        out = self._prefill(chunks, rows, row_of, T, width)
        if self.drafter is not None:  # prompts now complete, or but for a last token that decode feeds
            self._write_history([c.seq for c in chunks if c.start + c.num_tokens >= len(c.seq.token_ids) - 1])
        return out, row_of

    def decode(self, seqs: list[Sequence], draft: bool) -> tuple[Sampled, list[int], list[structured.Gate | None]]:
        """Dispatch one (multi-step) decode call for `seqs` -> (its sampled tokens `[steps, rows]`, each row, each
        row's structured-output mask: the host checks the tokens against it). With speculation, `draft` False runs
        one token per row (the engine's `disable_by_batch_size` decision; a call of more sequences than that limit
        has no drafting program: `buckets`)."""
        draft = draft and self.drafter is not None
        K = self.config.decode_tokens_per_call(draft)  # the positions the scheduler reserved for this call
        rows, row_of = self._rows(seqs, self.config.decode_buckets())
        width = self._width([s.decode_span(K)[0] + K for s in seqs], self._decode_widths)
        # Masks hold across a call's steps where its tokens are sampled one a step (not with speculation).
        gates = [_gate(s, holds=self.drafter is None) for s in seqs]
        greedy = rows <= self.config.greedy_program_rows and all(map(plain, seqs))
        return self._decode(seqs, rows, row_of, width, draft, greedy, gates), row_of, gates

    def set_stay_tokens(self, stay_W: np.ndarray) -> None:
        """The tokens a held structured-output mask holds across (`structured.stay_tokens`), onto the device: set
        with the first structured-output request (the sampler state keeps them)."""
        self._sampler_state = self._sampler_state.replace(
            stay_W=jax.device_put(stay_W, self._sampler_state.stay_W.sharding)
        )

    def _prefill_batch(
        self, chunks: list[PrefillChunk], rows: int, row_of: list[int], T: int, width: int
    ) -> steps.PrefillBatch:
        seqs = [c.seq for c in chunks]
        tokens = np.zeros((rows, T), np.int32)
        positions = np.full((rows, T), -1, np.int32)
        last = np.zeros((rows,), np.int32)
        for i, c in zip(row_of, chunks):
            tokens[i, : c.num_tokens] = c.seq.token_ids[c.start : c.start + c.num_tokens]
            positions[i, : c.num_tokens] = np.arange(c.start, c.start + c.num_tokens)
            last[i] = c.num_tokens - 1
        tables = self._tables(seqs, rows, width, row_of)
        batch = steps.PrefillBatch(
            tokens,
            positions,
            tables,
            last,
            self._sampling(seqs, rows, row_of, [_gate(s, holds=False) for s in seqs]),
            self._lists(seqs, rows, row_of),
        )
        if not self.prefill_drafts:
            return self._upload_step(batch)
        nxt = np.full((rows,), -1, np.int32)  # the token after each chunk where the host has it, else the sampled one
        for i, c in zip(row_of, chunks):
            end = c.start + c.num_tokens
            nxt[i] = c.seq.token_ids[end] if end < len(c.seq.token_ids) else -1
        return self._upload_step(steps.DraftingPrefillBatch(batch, nxt))

    def _decode_batch(
        self, seqs: list[Sequence], rows: int, row_of: list[int], width: int, slots: jax.Array, gates: list = ()
    ):
        K = self.config.decode_steps_per_call
        positions, last = np.full((rows,), -1, np.int32), np.zeros((rows,), np.int32)
        positions[row_of] = [s.decode_span(1)[0] for s in seqs]
        last[row_of] = [s.max_len - 1 for s in seqs]
        host = np.zeros((rows,), np.int32)  # -1: the input token is still on the device
        fed = np.full((rows, K), -1, np.int32)  # later steps' inputs from the host (-1: the step before's sample)
        for i, s in zip(row_of, seqs):
            n = s.fed_tokens
            host[i] = -1 if s.num_pending else s.token_ids[s.num_computed]
            fed[i, 1:n] = s.token_ids[s.num_computed + 1 : s.num_computed + min(n, K)]
        tokens = steps.load_tokens(self._last_tokens, slots, self._upload(host))
        tables = self._tables(seqs, rows, width, row_of)
        if (fed < 0).all():  # the usual call: no forced tokens, nothing more to upload
            if rows not in self._no_fed:
                self._no_fed[rows] = self._upload(fed)
            fed_BS = self._no_fed[rows]
        else:  # on the device as the cached one is (`_lists`)
            fed_BS = self._upload(fed)
        sb = self._sampling(seqs, rows, row_of, gates)
        batch = steps.DecodeBatch(tokens, positions, tables, sb, fed_BS, last)
        if self.drafter is None:
            return self._upload_step(batch)
        drafting, resume = np.zeros((rows,), bool), np.zeros((rows,), bool)
        drafting[row_of] = [drafts(s) for s in seqs]
        resume[row_of] = [s.spec_in_flight > 0 for s in seqs]
        return self._upload_step(steps.SpeculativeBatch(batch, drafting, resume))

    def _prefill(self, chunks: list[PrefillChunk], rows: int, row_of: list[int], T: int, width: int) -> Sampled:
        seqs = [c.seq for c in chunks]
        batch = self._prefill_batch(chunks, rows, row_of, T, width)
        if self.prefill_drafts:
            program = self._program(("prefill", rows, T, width), steps.prefill_drafting, batch)
            out, self.cache, (self._sampler_state, self._draft_state) = program(*self._args("prefill", batch))
        else:
            program = self._program(("prefill", rows, T, width), steps.prefill, batch)
            out, self.cache, self._sampler_state = program(self.params, self.cache, self._sampler_state, batch)
        self._last_tokens = steps.store_tokens(self._last_tokens, self._slots(seqs, rows, row_of), out.tokens)
        return out

    def _decode(
        self,
        seqs: list[Sequence],
        rows: int,
        row_of: list[int],
        width: int,
        draft: bool,
        greedy: bool,
        gates: list = (),
    ) -> Sampled:
        slots = self._slots(seqs, rows, row_of)
        batch = self._decode_batch(seqs, rows, row_of, width, slots, gates)
        if self.drafter is not None:  # the step keeps each slot's next token and position in its `DraftState`
            program = self._program(("decode", rows, width, draft, greedy), steps.decode_speculative, batch)
            out, self.cache, (self._sampler_state, self._draft_state) = program(*self._args("decode", batch))
            return out
        program = self._program(("decode", rows, width, False, greedy), steps.decode, batch)
        out, self.cache, self._sampler_state = program(self.params, self.cache, self._sampler_state, batch)
        self._last_tokens = steps.store_tokens(self._last_tokens, slots, out.tokens)
        return out

    def _args(self, kind: str, batch) -> tuple:
        """A step's arguments: with speculation, decode (and prefill, with `prefill_drafts`) takes the drafter's
        weights and state beside the target's."""
        if (kind == "decode" and self.drafter is not None) or (kind == "prefill" and self.prefill_drafts):
            return (self.params, self.draft_params), self.cache, (self._sampler_state, self._draft_state), batch
        return self.params, self.cache, self._sampler_state, batch

    def _st(self, key: tuple) -> steps.StepConfig:
        if key[0] != "decode":
            return self.st_decode if self.prefill_drafts else self.st
        st = self.st_no_draft if self.drafter is not None and not key[3] else self.st_decode
        return dataclasses.replace(st, plain=True) if key[4] else st

    def _drafting_bucket(self, rows: int) -> bool:
        """Whether a speculative decode call of `rows` (padded) rows can draft: the fewest sequences such a call
        holds (one more than the next smaller bucket's, on one attention rank) are not more than
        `speculative_config.disable_by_batch_size`, the most requests enqueued while calls draft."""
        limit = self.config.speculative_config.disable_by_batch_size
        smaller = [b for b in self.config.decode_buckets() if b < rows // self.num_ranks]
        return limit is None or max(smaller, default=0) + 1 <= limit

    def _write_history(self, seqs: list[Sequence]) -> None:
        """The drafter history of sequences whose prompt is (all but) computed: their last tokens (and the rest of the
        oracle's known continuation), one fixed-shape call of `max_prefill_seqs` rows."""
        if not seqs:
            return
        spec, N = self.config.speculative_config, self.drafter.history_tokens
        rows = np.full((self.config.max_prefill_seqs, N), -1, np.int32)
        slots = np.full((self.config.max_prefill_seqs,), self._spare_slot, np.int32)
        for i, s in enumerate(seqs):
            ids = spec.reference(s.token_ids) if spec.method == "oracle" else s.token_ids
            start = max(0, len(ids) - N)
            rows[i, np.arange(start, len(ids)) % N] = ids[start:]
            slots[i] = s.slot
        self._draft_state = steps.write_history(self._draft_state, *self._upload((slots, rows)))

    def _program(self, key: tuple, step, batch):
        """The compiled `step` for a bucket: from warm-up, else from the program store, else compiled now (and kept,
        in memory and in the store)."""
        program = self._programs.get(key)
        if program is None:
            args = self._args(key[0], batch)
            stored = self.store.key(key[0], self._st(key), args)
            program = self.store.load(stored, self._devices)
            if program is None:
                program = self.store.compile(step.lower(*args, st=self._st(key)), stored)
            self._programs[key] = program
        return program

    def buckets(self) -> list[tuple]:
        """Every program the scheduler can ask for: ("decode", rows, table width, drafts, greedy) and ("prefill",
        rows, tokens, table width). With speculation, a decode bucket has a drafting program (drafts True) and, with
        `disable_by_batch_size`, a non-drafting one, or only the latter where its calls have too many sequences to
        draft; without speculation, one program without drafts (drafts False). Buckets of up to
        `greedy_program_rows` rows have each twice: for calls whose rows are all `plain` (greedy True: no
        conditionals) and for the others."""
        ec, R = self.config, self.num_ranks
        spec = self.drafter is not None
        limited = spec and ec.speculative_config.disable_by_batch_size is not None
        decode = []
        for w in self._decode_widths:
            for b in ec.decode_buckets():
                for greedy in (True, False) if R * b <= ec.greedy_program_rows else (False,):
                    if spec and self._drafting_bucket(R * b):
                        decode.append(("decode", R * b, w, True, greedy))
                    if limited or not spec:
                        decode.append(("decode", R * b, w, False, greedy))
        prefill = [
            ("prefill", R * b, T, w)
            for w in self._prefill_widths
            for b in ec.prefill_row_buckets()
            for T in ec.prefill_token_buckets()
        ]
        return decode + prefill

    def warmup(self, on_progress: Callable[[str, int, int, str], None] | None = None) -> None:
        """Make every bucket's program ready now: loaded from the program store where it is there (on threads),
        else compiled in parallel: the steps are traced and lowered one after another (that holds the interpreter)
        while XLA compiles the earlier ones on other threads, one per core. Then, on a GPU, each runs once on an
        all-padding batch through the same dispatch code as serving, so that no kernel loads at a first request.
        Reports `on_progress(stage, done, total, detail)` as programs are loaded, traced, compiled and run (stages
        "loading programs", "tracing", "compiling", "first run")."""
        report, ec = on_progress or (lambda *a: None), self.config
        todo = [k for k in self.buckets() if k not in self._programs]
        t0, n = time.perf_counter(), len(todo)
        lock, done = threading.Lock(), collections.Counter()

        def finished(stage, key, future):
            with lock:
                done[stage] += 1
                report(stage, done[stage], n, f"{self._label(key)} {time.perf_counter() - t0:.1f}s")

        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            work = {key: self._padding(key) for key in todo}
            stored = {key: self.store.key(key[0], self._st(key), self._args(key[0], b)) for key, (_, b) in work.items()}
            loads = {key: pool.submit(self.store.load, stored[key], self._devices) for key in todo}
            missing = []
            for key in todo:
                program = loads[key].result()
                if program is None:
                    missing.append(key)
                    continue
                self._programs[key] = program
                finished("loading programs", key, None)
            compiles = {}
            for i, (key, lowered) in enumerate(self._lower_all(missing, work), 1):
                report("tracing", i, n, self._label(key))
                compiles[key] = pool.submit(self.store.compile, lowered, stored[key])
                compiles[key].add_done_callback(functools.partial(finished, "compiling", key))
            for key, future in compiles.items():
                self._programs[key] = future.result()
        if self.drafter is not None:
            slots = np.full(ec.max_prefill_seqs, self._spare_slot, np.int32)
            rows = np.full((ec.max_prefill_seqs, self.drafter.history_tokens), -1, np.int32)
            self._draft_state = steps.write_history(self._draft_state, *self._upload((slots, rows)))
        if self.kernels.device.platform != "gpu":
            return self._warm_helpers()  # nothing compiles at a first run here, where each costs real time
        self.check_temporaries(jax.devices()[0].memory_stats() or {})
        for i, key in enumerate(self.buckets(), 1):
            if key[0] == "decode":
                self._decode([], key[1], [], key[2], key[3], key[4])
            else:
                self._prefill([], key[1], [], key[2], key[3])
            report("first run", i, len(self.buckets()), self._label(key))
        jax.block_until_ready((self.cache, self._last_tokens, self._sampler_state))

    def largest_temporaries(self) -> tuple[tuple, int]:
        """The compiled step that needs the most device memory besides its arguments, and how much: XLA's temporaries
        plus its outputs not written over a donated input (the cache is; sampled tokens and logits are not)."""

        def extra(program) -> int:
            m = program.memory_analysis()  # None where a platform keeps no such statistics
            return 0 if m is None else m.temp_size_in_bytes + max(0, m.output_size_in_bytes - m.alias_size_in_bytes)

        sizes = {key: extra(p) for key, p in self._programs.items()}
        key = max(sizes, key=sizes.get)
        return key, sizes[key]

    def check_temporaries(self, stats: dict) -> None:
        """Before any step runs: the largest one's temporaries must fit in what the weights and the KV cache left free
        (the cache was sized with an estimate, `kv_cache.activation_bytes`); else a clear error, not an allocator's
        out-of-memory at the first long prompt. `stats`: the device's `memory_stats()`."""
        if "bytes_limit" not in stats or not self._programs:
            return
        key, need = self.largest_temporaries()
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        log.info(
            "largest step: %s needs %.2f GiB of temporaries, %.2f GiB free",
            self._label(key),
            need / 2**30,
            free / 2**30,
        )
        if need > free:
            raise ValueError(
                f"the {self._label(key)} step needs {need / 2**30:.1f} GiB of device memory for its temporaries, and "
                f"{free / 2**30:.1f} GiB is free after the weights and the KV cache: lower gpu_memory_utilization "
                f"(now {self.config.gpu_memory_utilization}) or set num_pages to give the cache less, or lower "
                f"max_num_batched_tokens ({self.config.max_num_batched_tokens}) or prefill_chunk_size "
                f"({self.config.prefill_chunk_size})"
            )

    def _lower_all(self, keys: list[tuple], work: dict) -> Iterator[tuple[tuple, jax.stages.Lowered]]:
        """`(key, lowered step)` of each bucket in `keys`, as they are ready: lowered in worker processes
        (`lowering.Workers`, `EngineConfig.compile_workers`) on one device, else here, one after another."""
        count = self.config.compile_workers
        if count is None:
            count = lowering.default_workers(self.kernels.device.platform, len(keys))

        def here(key):
            step, batch = work[key]
            return step.lower(*self._args(key[0], batch), st=self._st(key))

        workers = None
        if self.layout is None and count > 0 and keys:
            try:
                workers = lowering.Workers(min(count, len(keys)))
            except Exception as e:  # noqa: BLE001 - no processes to start here: lower in this one
                log.warning("lowering workers not started (%s: %s); lowering here", type(e).__name__, e)
        if workers is None:
            for key in keys:
                yield key, here(key)
            return
        try:
            futures, local = {}, []
            for key in keys:
                step, batch = work[key]
                try:
                    futures[workers.submit(step, self._st(key), self._args(key[0], batch))] = key
                except Exception as e:  # noqa: BLE001 - settings that cannot travel: lowered here
                    log.warning("%s cannot go to a lowering worker (%s: %s)", self._label(key), type(e).__name__, e)
                    local.append(key)
            for key in local:
                yield key, here(key)
            for future in concurrent.futures.as_completed(futures):  # each as it lands: XLA compiles it meanwhile
                key = futures[future]
                try:
                    lowered = lowering.lowered(future.result(), self._args(key[0], work[key][1]))
                except Exception as e:  # noqa: BLE001 - a worker's failure costs time, never the start
                    log.warning(
                        "lowering %s in a worker failed (%s: %s); lowering it here",
                        self._label(key),
                        type(e).__name__,
                        e,
                    )
                    yield key, here(key)
                    continue
                self.lowered_in_workers += 1
                yield key, lowered
        finally:
            workers.close()

    def _warm_helpers(self) -> None:
        """Compile the small programs that carry each call's sampled tokens to the next (`steps.load_tokens`,
        `steps.store_tokens`) for every bucket, on arguments like the real calls' (the steps' outputs: their shape,
        dtype and placement), without running the steps themselves."""
        for key in self.buckets():
            program = self._programs[key]
            tokens, placed = jax.tree.leaves(program.out_info)[0], jax.tree.leaves(program.output_shardings)[0]
            slots = self._slots([], key[1], [])
            if key[0] == "decode":
                steps.load_tokens(self._last_tokens, slots, self._upload(np.zeros(key[1], np.int32)))
            if key[0] == "decode" and self.drafter is not None:
                continue  # speculative decode calls do not write the last-token table (their `DraftState` has it)
            sampled = jax.device_put(np.zeros(tokens.shape, tokens.dtype), placed)  # `Sampled.tokens`
            self._last_tokens = steps.store_tokens(self._last_tokens, slots, sampled)
        jax.block_until_ready(self._last_tokens)

    def _label(self, key: tuple) -> str:
        if key[0] == "decode":
            _, rows, width, drafts, greedy = key
            plain = " no drafts" if self.drafter is not None and not drafts else ""
            return f"decode rows={rows} ctx={width * self.config.page_size}{plain}{' greedy' if greedy else ''}"
        _, rows, tokens, width = key
        return f"prefill rows={rows} tokens={tokens} ctx={width * self.config.page_size}"

    def _padding(self, key: tuple):
        """The step of a bucket and an all-padding batch of its shape."""
        kind, rows, size = key[:3]
        if kind == "decode":
            step = steps.decode if self.drafter is None else steps.decode_speculative
            return step, self._decode_batch([], rows, [], size, self._slots([], rows, []))
        step = steps.prefill_drafting if self.prefill_drafts else steps.prefill
        return step, self._prefill_batch([], rows, [], size, key[3])

    def run(self, step_fn, *args) -> Any:
        """`step_fn(params, cache, *args) -> (result, cache)` on this runner's parameters and cache (donated)."""
        result, self.cache = step_fn(self.params, self.cache, *args)
        return result

    def prompt_chunk(self, seq: Sequence, start: int, n: int) -> tuple[jax.Array, jax.Array, model.PageTables]:
        """Tokens, positions and tables of `seq`'s positions `[start, start + n)` as row 0 of a prefill-shaped call
        (the other ranks get one padding row each), for `Engine.run_prompt`."""
        T = bucket(n, self.config.prefill_token_buckets())
        rows = self.num_ranks
        tokens = np.zeros((rows, T), np.int32)
        positions = np.full((rows, T), -1, np.int32)
        tokens[0, :n], positions[0, :n] = seq.token_ids[start : start + n], np.arange(start, start + n)
        return self._upload((tokens, positions, self._tables([seq], rows, self._width([start + n]))))

    # ---- packing -----------------------------------------------------------------------------------------------
    def _rows(self, seqs: list[Sequence], buckets: tuple[int, ...]) -> tuple[int, list[int]]:
        """Padded row count and each sequence's row. Rows are rank-major: rank `r` owns rows
        `[r * rows/R, (r + 1) * rows/R)`, each rank's share padded to the same bucket."""
        if self.num_ranks == 1:
            return padded_rows([len(seqs)], buckets), list(range(len(seqs)))
        counts, where = [0] * self.num_ranks, []
        for s in seqs:
            where.append((s.pages.rank, counts[s.pages.rank]))
            counts[s.pages.rank] += 1
        rows = padded_rows(counts, buckets)
        per = rows // self.num_ranks
        return rows, [r * per + i for r, i in where]

    def _upload(self, batch):
        """`batch` (a pytree) with every host array in it onto the device(s), rows split over the attention ranks, in
        one `device_put` call (still one transfer per array: a step's batch on one device goes packed, `_upload_step`).
        A transfer, not `jnp.asarray`, whose staging computation waited behind the calls in flight (a prefill's
        length: BENCHMARKS §12c). Device arrays in it (the packing's cached zeros) stay."""
        leaves, treedef = jax.tree.flatten(batch)
        where = [i for i, x in enumerate(leaves) if isinstance(x, np.ndarray)]
        host = [leaves[i] for i in where]
        if self.layout is None:
            moved = jax.device_put(host)
        else:
            moved = jax.device_put(host, [self.layout.named(self.layout.batch_spec(x.ndim)) for x in host])
        for i, x in zip(where, moved):
            leaves[i] = x
        return treedef.unflatten(leaves)

    def _upload_step(self, batch):
        """A step's batch onto the device. On one device its host arrays go as one buffer (`upload.pack`; the step
        slices them back): one transfer where each array cost its own (BENCHMARKS §35). Under a layout each array is
        split over the attention ranks by rows (`_upload`)."""
        if self.layout is not None:
            return self._upload(batch)
        packed = upload.pack(batch)
        return dataclasses.replace(packed, words=jax.device_put(packed.words))

    def _width(self, end_positions: list[int], buckets: tuple[int, ...] | None = None) -> int:
        """The block-table width (pages) of a call whose positions end before `end_positions`: its bucket."""
        buckets = buckets or self._ctx_buckets
        pages = math.ceil(max(end_positions) / self.config.page_size)
        return bucket(min(pages, buckets[-1]), buckets)

    def _tables(self, seqs: list[Sequence], rows: int, width: int, row_of: list[int] | None = None) -> model.PageTables:
        sliding = np.zeros((rows, width), np.int32)
        full = np.zeros((rows, width), np.int32)
        cached = np.zeros((rows,), np.int32)
        for i, seq in zip(row_of or range(len(seqs)), seqs):
            s, f = seq.pages.sliding[:width], seq.pages.full[:width]
            sliding[i, : len(s)], full[i, : len(f)], cached[i] = s, f, seq.full_cached
        return model.PageTables(sliding, full, cached)  # host arrays: the batch is uploaded whole (`_upload`)

    def _sampling(
        self, seqs: list[Sequence], rows: int, row_of: list[int], gates: list[structured.Gate | None] = ()
    ) -> SamplingBatch:
        """The rows' sampling parameters; `gates`: each sequence's structured-output mask, if any."""
        temperature, top_p = np.zeros(rows, np.float32), np.ones(rows, np.float32)
        top_k, min_p = np.zeros(rows, np.int32), np.zeros(rows, np.float32)
        keys, want = np.zeros((rows, 2), np.uint32), np.zeros(rows, bool)
        penalties = np.tile(np.array([0, 0, 1], np.float32), (rows, 1))  # presence, frequency, repetition
        proc = np.zeros((rows, 4), np.int32)  # flags, min_tokens, prompt length, slot
        proc[:, 3] = self._spare_slot
        for i, s in zip(row_of, seqs):
            p = s.params
            temperature[i], top_k[i], top_p[i], min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
            keys[i], want[i] = s.key, p.logprobs is not None
            proc[i, 2:] = s.num_prompt_tokens, s.slot
            if p.uses_processors:
                penalties[i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
                proc[i, :2] = _flags(p), p.min_tokens
        masked, mask, mask_pos, holds = self._masks(rows, [(i, g) for i, g in zip(row_of, gates) if g is not None])
        return SamplingBatch(  # host arrays but the masks: the batch is uploaded whole (`_upload_step`)
            temperature_B=temperature,
            top_k_B=top_k,
            top_p_B=top_p,
            min_p_B=min_p,
            keys_B2=keys,
            want_logprobs_B=want,
            masked_B=masked,
            mask_BW=mask,
            mask_pos_B=mask_pos,
            holds_B=holds,
            penalties_B3=penalties,
            proc_B4=proc,
        )

    def _masks(self, rows: int, gates: list[tuple[int, structured.Gate]]) -> tuple:
        """`SamplingBatch.masked_B`, `.mask_BW`, `.mask_pos_B` and `.holds_B`: the rows' structured-output masks, on
        the device (as `_lists`). A call without any reuses one all-zero set per row count, already there (no per-call
        upload of `[B, V/32]`)."""
        words = structured.mask_words(self.model_config.vocab_size)
        if not gates:
            if rows not in self._no_mask:
                zeros = (np.zeros(rows, bool), np.zeros((rows, words), np.int32), np.zeros(rows, np.int32))
                self._no_mask[rows] = self._upload((*zeros, zeros[0]))
            return self._no_mask[rows]
        masked, mask = np.zeros(rows, bool), np.zeros((rows, words), np.int32)
        mask_pos, holds = np.zeros(rows, np.int32), np.zeros(rows, bool)
        for i, g in gates:
            masked[i], mask[i], mask_pos[i], holds[i] = True, g.mask, g.position, g.holds
        return self._upload((masked, mask, mask_pos, holds))

    def _lists(self, seqs: list[Sequence], rows: int, row_of: list[int]) -> sampling.SamplingLists:
        """The prefill rows' logits-processor lists (`sampling.SamplingLists`), on the device: where no row has any,
        the empty ones already there (nothing to pack or copy), else uploaded here. Device arrays either way, so that a
        step's packed batch (`_upload_step`) has one layout whatever its rows ask for."""
        V = self.model_config.vocab_size
        if not any(s.params.uses_processors for s in seqs):
            if rows not in self._no_lists:
                self._no_lists[rows] = self._upload(sampling.empty_lists(rows, V))
            return self._no_lists[rows]
        out = sampling.empty_lists(rows, V)
        for i, s in zip(row_of, seqs):
            p = s.params
            if p.logit_bias:
                out.bias_ids_BN[i, : len(p.logit_bias)] = list(p.logit_bias)
                out.bias_BN[i, : len(p.logit_bias)] = list(p.logit_bias.values())
            if p.allowed_token_ids:
                out.allowed_BA[i, : len(p.allowed_token_ids)] = p.allowed_token_ids
            for w, word in enumerate(s.bad_words_ids):
                out.bad_BWL[i, w, -len(word) :] = word
            if p.min_tokens:
                out.stops_BK[i, : len(p.stop_token_ids)] = p.stop_token_ids
        return self._upload(out)

    def _slots(self, seqs: list[Sequence], rows: int, row_of: list[int]) -> jax.Array:
        slots = np.full((rows,), self._spare_slot, np.int32)
        for i, s in zip(row_of, seqs):
            slots[i] = s.slot
        return self._upload(slots)


def _gate(seq: Sequence, holds: bool) -> structured.Gate | None:
    """A structured-output row's mask for the call being packed (`structured.Constraint.gate`)."""
    return None if seq.constraint is None else seq.constraint.gate(seq.num_pending > 0, holds)


def plain(seq: Sequence) -> bool:
    """Whether a sequence's sampling needs no more than the argmax: greedy, without logits processors, a structured
    output or log-probabilities (calls of such rows alone take programs without the sampler's conditionals)."""
    p = seq.params
    return p.temperature == 0 and not p.uses_processors and p.logprobs is None and seq.constraint is None


def drafts(seq: Sequence) -> bool:
    """Whether a sequence drafts under speculative decoding: not with structured outputs (the grammar's mask holds
    for one token per call) nor with logits processors (penalties, bad words, min_tokens, logit bias, allowed tokens:
    their per-slot state advances one token at a time); those rows take one token per step."""
    return seq.constraint is None and not seq.params.uses_processors


def _flags(p) -> int:
    """`sampling.USES_*` of one request's `SamplingParams`."""
    return (
        sampling.USES_PENALTIES * bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1)
        | sampling.USES_BIAS * bool(p.logit_bias)
        | sampling.USES_ALLOWED * bool(p.allowed_token_ids)
        | sampling.USES_BAD_WORDS * bool(p.bad_words)
        | sampling.USES_MIN_TOKENS * bool(p.min_tokens)
    )
