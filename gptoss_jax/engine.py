"""The serving engine: requests in, tokens out, one scheduler + device step at a time.

`Engine.step()` asks the scheduler for this step's work (prefill chunks and decoding sequences) and has the
model runner (`runner.ModelRunner`: parameters, KV cache, input packing, device calls) dispatch one compiled
prefill call and one compiled (multi-step) decode call. With async
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
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable
from typing import Sequence as Seq

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

import pallas_kernels
from gptoss_jax import checkpoint, demo, engine_config, kv_cache, runtime, steps, structured
from gptoss_jax import tokenizer as tokenizer_lib
from gptoss_jax.config import ModelConfig
from gptoss_jax.engine_config import EngineConfig
from gptoss_jax.program_store import ProgramStore
from gptoss_jax.runner import ModelRunner
from gptoss_jax.runner import drafts as runner_drafts
from gptoss_jax.sampling import (
    EOS_TOKEN_IDS,
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    Sampled,
    SamplingParams,
    find_stop_string,
)
from gptoss_jax.scheduler import Scheduler, Sequence
from pallas_kernels.params import Params
from sharding.rules import make_layout

log = logging.getLogger(__name__)
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
# CPU and some backends cannot reuse donated buffers; that only costs a copy.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")


@dataclasses.dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None  # the stop token id (not in the output) or stop string
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    error: str | None = None  # with finish_reason "error": why this request failed (the engine goes on)


@dataclasses.dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of full-layer pages held by requests
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_compiles: int  # process-wide compiled step programs
    # Speculative decoding (vLLM's spec_decode counters): verify steps of drafting rows, draft tokens they checked,
    # drafts accepted, and accepted drafts by position (index i: the (i + 1)-th draft of a step).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Call:
    """A dispatched step whose sampled tokens the host has not read yet. Entries carry the sequence's
    epoch at dispatch: a sequence that left the batch since (finished, aborted, preempted) is skipped."""

    prefills: list[tuple[Sequence, int, int, bool]]  # sequence, row, epoch, chunk ends the prompt
    # sequence, row, epoch, steps whose samples are not its tokens, the mask its samples were drawn under
    decodes: list[tuple[Sequence, int, int, int, structured.Gate | None]]
    prefill_out: Sampled | None
    decode_out: Sampled | None
    drafted: bool = False  # a speculative decode call that drafted (`Engine._drafts`): its acceptance counts


class Engine:
    """Continuous-batching engine over a paged KV cache. `model=None` loads the built-in demo checkpoint;
    `loaded=(model_config, params)` uses parameters already on device. `config` is an `EngineConfig`, a
    YAML path or a profile name ('low_latency', 'max_throughput'); `overrides` replace its fields.
    `compile_cache_dir`: where compiled steps persist across processes (`runtime.compile_cache_dir`: default
    `$GPTOSS_JAX_HOME/compile-cache`; False turns it off). `on_progress(stage, done, total, detail)` hears of the
    weights' loading and of warm-up, program by program (the server's /health reports it). `model` is a checkpoint
    folder or a Hugging Face repo id (`checkpoint.resolve_model`, with `revision` and `download_dir`)."""

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        dtype: str = "bfloat16",
        config: EngineConfig | str | os.PathLike | None = None,
        tokenizer: Any = None,
        impl: str | None = None,
        seed: int = 0,
        loaded: tuple[ModelConfig, Params] | None = None,
        cache_dir: str | os.PathLike | None = None,
        compile_cache_dir: str | os.PathLike | bool | None = None,
        progress: bool = True,
        on_progress: Callable[[str, int, int, str], None] | None = None,
        layout=None,
        revision: str | None = None,
        download_dir: str | os.PathLike | None = None,
        **overrides: Any,
    ):
        self._on_progress, self._progress_bar = on_progress, progress
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}: choose one of {sorted(DTYPES)}")
        self.config = ec = engine_config.load(config, **overrides)
        self.compile_cache_dir = runtime.prepare(compile_cache_dir, ec.gpu_memory_utilization)
        # Which kernels run (`pallas_kernels.choice`), resolved for this device; `impl` overrides the config's.
        self.kernels = (ec.kernels if impl is None else dataclasses.replace(ec.kernels, impl=impl)).for_device()
        # Several devices: `layout` (a sharding.rules.Layout) or the config's mesh; None = one device.
        if layout is None and ec.model_parallel * ec.replicas > 1:
            layout = make_layout(ec.model_parallel, ec.replicas, ec.parallel_mode, dispatch=ec.expert_dispatch)
        self.layout = layout
        self.num_ranks = layout.num_ranks if layout is not None else 1
        t0 = time.perf_counter()
        self._report("loading weights", 0, 1, str(model or "the demo checkpoint"))
        self._owns_params = loaded is None
        self._owns_bf16_experts = False
        if loaded is None:
            self.model_path: Path | None = (
                checkpoint.resolve_model(model, revision=revision, download_dir=download_dir)
                if model is not None
                else demo.checkpoint_path()
            )
            self.model_config, params = checkpoint.load_placed(
                self.model_path, DTYPES[dtype], self.kernels, layout, cache_dir=cache_dir, progress=progress
            )
        else:
            self.model_path = Path(model) if model is not None else None
            self.model_config, params = loaded
            given = getattr(params.layers.experts, "gu_bf16", None)
            if layout is not None:
                params = layout.shard_params(params, self.model_config.num_kv_heads)
            params = pallas_kernels.prepare_params(params, self.kernels)  # sharded: each device its experts
            made = getattr(params.layers.experts, "gu_bf16", None)
            # a bf16 copy of the experts made here (`KernelConfig.moe_prefill_bf16_experts`) is this engine's to free
            self._owns_bf16_experts = given is None and made is not None
        self._report("loading weights", 1, 1, f"{time.perf_counter() - t0:.1f}s")
        self.tokenizer = tokenizer
        if isinstance(tokenizer, (str, os.PathLike)) or (
            tokenizer is None and self.model_config.vocab_size == tokenizer_lib.VOCAB_SIZE
        ):
            self.tokenizer = tokenizer_lib.load(tokenizer, self.model_path)

        mc = self.model_config
        self.runner = ModelRunner(mc, params, ec, self.kernels, layout, ProgramStore(self.compile_cache_dir))
        kv_args = (
            self.runner.num_pages_full,
            self.runner.num_pages_sliding,
            ec.page_size,
            mc.sliding_window,
            (mc.num_layers + 1) // 2,
            ec.enable_prefix_caching,
        )
        self.kv = (
            kv_cache.KVCacheManager(*kv_args)
            if self.num_ranks == 1
            else kv_cache.RankedKVCacheManager(self.num_ranks, *kv_args)
        )
        self.max_model_len = self.runner.max_model_len
        self.scheduler = Scheduler(ec, self.kv)
        self._in_flight: _Call | None = None
        self._requests: dict[str, Sequence] = {}
        self._aborted: list[StepOutput] = []
        self._rng = np.random.default_rng(seed)
        self._prompt_tokens = self._generation_tokens = 0
        spec = ec.speculative_config
        self._spec_counts = [0, 0, 0]  # drafts, draft tokens, accepted tokens
        self._spec_per_pos = [0] * (spec.num_speculative_tokens if spec is not None else 0)
        self._stay_set = False  # the device has the tokens a structured-output mask holds across
        if ec.warmup:
            self.warmup()

    @property
    def params(self) -> Params:
        return self.runner.params

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
            raise ValueError(
                f"request {request_id}: token id {bad[0]} is outside the vocabulary [0, {self.model_config.vocab_size})"
            )
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"request {request_id}: prompt has {len(ids)} tokens; the context limit is "
                f"{self.max_model_len} (max_model_len) including at least one generated token"
            )
        sp = sampling_params
        if sp.top_k > self.model_config.vocab_size:
            raise ValueError(
                f"SamplingParams.top_k={sp.top_k}: at most the vocabulary size {self.model_config.vocab_size} "
                "(0 disables it)"
            )
        if sp.n != 1:
            raise ValueError(
                f"request {request_id}: SamplingParams.n={sp.n}; the engine runs one sequence per request "
                "(LLM.generate and the server fan n out into n requests)"
            )
        if sp.logprobs is not None and sp.logprobs > self.config.max_logprobs:
            raise ValueError(
                f"SamplingParams.logprobs={sp.logprobs}: at most max_logprobs={self.config.max_logprobs} are served"
            )
        if sp.stop and self.tokenizer is None:
            raise ValueError(
                f"SamplingParams.stop={list(sp.stop)!r}: stop strings need a tokenizer, and this "
                "model has none (use stop_token_ids)"
            )
        V = self.model_config.vocab_size
        for name, listed in (("logit_bias", sp.logit_bias or ()), ("allowed_token_ids", sp.allowed_token_ids or ())):
            out_of_range = [t for t in listed if not 0 <= t < V]
            if out_of_range:
                raise ValueError(
                    f"SamplingParams.{name}: token id {out_of_range[0]} is outside the vocabulary [0, {V})"
                )
        if sp.best_of not in (None, 1):
            raise ValueError(
                f"request {request_id}: SamplingParams.best_of={sp.best_of}; the engine runs one sequence per request "
                "(LLM.generate and the server choose the n best of best_of requests)"
            )
        seed = sp.seed if sp.seed is not None else int(self._rng.integers(2**31))
        key = ((seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF)
        seq = Sequence(request_id, ids, len(ids), sp, key, min(len(ids) + sp.max_tokens, self.max_model_len))
        seq.feeds_forced = self.config.speculative_config is None
        seq.constraint = self._constraint(request_id, sp, ids, seq.max_len)
        seq.bad_words_ids = self.bad_words_ids(sp.bad_words)
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        self._prompt_tokens += len(ids)

    def _constraint(
        self, request_id: str, sp: SamplingParams, prompt: list[int], max_len: int
    ) -> structured.Constraint | None:
        """The structured-output state of a request with `structured_outputs` or a `thinking_token_budget`."""
        if sp.structured_outputs is None and sp.thinking_token_budget is None:
            return None
        if self.tokenizer is None:
            raise ValueError(f"request {request_id}: structured outputs need a tokenizer, and this model has none")
        so = sp.structured_outputs
        grammar = structured.compile_grammar(so, self.tokenizer) if so is not None else None
        budget = sp.thinking_token_budget if sp.thinking_token_budget is not None else sp.max_tokens // 2
        constraint = structured.Constraint(
            grammar, self.tokenizer, budget, self.model_config.vocab_size, prompt, max_len
        )
        if constraint.stay is not None and not self._stay_set:
            self.runner.set_stay_tokens(constraint.stay)
            self._stay_set = True
        return constraint

    def bad_words_ids(self, words) -> tuple[tuple[int, ...], ...]:
        """`bad_words` as the token sequences the sampler bans, as vLLM builds them: each word (leading spaces
        stripped) tokenized alone and, where that gives another first token and as many tokens, after a space
        (a word inside text). A ValueError past the capacities (`sampling.MAX_BAD_WORDS` sequences of at most
        `sampling.MAX_BAD_WORD_TOKENS` tokens)."""
        if not words:
            return ()
        if self.tokenizer is None:
            raise ValueError(
                f"SamplingParams.bad_words={list(words)!r}: bad words need a tokenizer; this model has none"
            )
        out: list[tuple[int, ...]] = []
        for word in words:
            plain = tuple(self.tokenizer.encode(word.lstrip()))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip()))
            for ids in (plain, spaced) if spaced[0] != plain[0] and len(spaced) == len(plain) else (plain,):
                if len(ids) > MAX_BAD_WORD_TOKENS:
                    raise ValueError(
                        f"SamplingParams.bad_words: {word!r} is {len(ids)} tokens; at most {MAX_BAD_WORD_TOKENS} "
                        "are supported"
                    )
                out.append(ids)
        if len(out) > MAX_BAD_WORDS:
            raise ValueError(
                f"SamplingParams.bad_words: {len(words)} words make {len(out)} token sequences (with and without "
                f"a leading space); at most {MAX_BAD_WORDS} are supported"
            )
        return tuple(out)

    def abort_request(self, request_id: str) -> None:
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return
        self.scheduler.remove(seq)
        self._aborted.append(
            StepOutput(request_id, [], True, "abort", None, None, seq.num_prompt_tokens, seq.num_cached_prompt_tokens)
        )

    def close(self) -> None:
        """Free this engine's device memory now: the KV cache, and the parameters it loaded itself (of those given
        as `loaded`, only the bf16 copy of their experts it made). A new engine in the same process sizes its cache
        from the device's memory, so it must not wait for garbage collection. The engine is unusable afterwards;
        closing twice is harmless."""
        self._in_flight = None
        self.runner.close(params=self._owns_params)
        if self._owns_bf16_experts:  # the copy made from parameters given as `loaded` (38 GB for 20b)
            experts = self.runner.params.layers.experts
            for a in (experts.gu_bf16, experts.dn_bf16):
                if not a.is_deleted():
                    a.delete()

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._aborted)

    def stats(self) -> EngineStats:
        return EngineStats(
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            self.kv.usage(),
            self.scheduler.num_preemptions,
            self._prompt_tokens,
            self._generation_tokens,
            sum(steps.TRACES.values()),
            *self._spec_counts,
            list(self._spec_per_pos),
        )

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One scheduler step. A fault confined to some requests (a value the packing rejects, a sampler or
        stop-string error, a device call that fails) ends those requests with finish reason "error"; the
        others, and the engine, go on."""
        outputs, self._aborted = self._aborted, []
        drafts = self._drafts()
        work = self.scheduler.schedule(drafts)
        try:
            call = None if work.empty else self._launch(work, drafts)
        except Exception as e:  # noqa: BLE001 - the step's requests fail, the engine goes on
            call = None
            outputs += self._fail([c.seq for c in work.prefills] + list(work.decodes), e)
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:  # read while `call` runs on the device
            outputs += self._collect(in_flight)
        if call is not None:
            if self.config.async_scheduling:
                self._in_flight = call
            else:
                outputs += self._collect(call)
        return outputs

    def _fail(self, seqs: list[Sequence], error: BaseException) -> list[StepOutput]:
        """End `seqs` with finish reason "error". Their pages are freed without entering the prefix cache (the
        failed call may have left them half written)."""
        log.error("engine step failed for %d request(s)", len(seqs), exc_info=error)
        out = []
        for seq in dict.fromkeys(seqs):  # in order, once each
            if self._requests.get(seq.request_id) is not seq:
                continue  # already finished or aborted
            del self._requests[seq.request_id]
            self.scheduler.remove(seq, cache=False)
            msg = f"request {seq.request_id} failed in the engine: {type(error).__name__}: {error}"
            out.append(
                StepOutput(
                    seq.request_id,
                    [],
                    True,
                    "error",
                    None,
                    None,
                    seq.num_prompt_tokens,
                    seq.num_cached_prompt_tokens,
                    msg,
                )
            )
        return out

    def _launch(self, work, drafted: bool) -> _Call:
        """Enqueue this step's prefill and decode calls (neither waits for the other); the decode call drafts when
        `drafted` (`_drafts`)."""
        pre = self.runner.prefill(work.prefills) if work.prefills else (None, [])
        dec = self.runner.decode(work.decodes, drafted) if work.decodes else (None, [], [])
        call = _Call(
            [
                (c.seq, row, c.seq.epoch, c.start + c.num_tokens == len(c.seq.token_ids))
                for row, c in zip(pre[1], work.prefills)
            ],
            [(seq, row, seq.epoch, seq.fed_tokens - 1, gate) for row, seq, gate in zip(dec[1], work.decodes, dec[2])],
            pre[0],
            dec[0],
            drafted,
        )
        self.scheduler.launched(work, drafted)
        return call

    def _drafts(self) -> bool:
        """Whether this step's decode call drafts: with speculation, unless more requests are enqueued (running and
        waiting) than `speculative_config.disable_by_batch_size`, as vLLM decides it."""
        spec = self.config.speculative_config
        if spec is None:
            return False
        return spec.disable_by_batch_size is None or len(self._requests) <= spec.disable_by_batch_size

    def _collect(self, call: _Call) -> list[StepOutput]:
        """Wait for a call's tokens and hand them to their sequences. Results that cannot be read (the device call
        failed) fail the sequences of that call."""
        outputs = []
        if call.prefills:
            try:
                sampled = _to_host(call.prefill_out, any(s.params.logprobs is not None for s, *_ in call.prefills))
            except Exception as e:  # noqa: BLE001 - this call's requests fail, the engine goes on
                outputs += self._fail([s for s, *_ in call.prefills], e)
            else:
                for seq, row, epoch, ends_prompt in call.prefills:
                    if ends_prompt and seq.epoch == epoch:
                        seq.num_pending -= 1
                        outputs += self._append_or_fail(seq, lambda: [_pick(sampled, (row,))])
        if call.decodes:
            try:
                sampled = _to_host(call.decode_out, any(s.params.logprobs is not None for s, *_ in call.decodes))
            except Exception as e:  # noqa: BLE001 - this call's requests fail, the engine goes on
                return outputs + self._fail([s for s, *_ in call.decodes], e)
            K = sampled[0].shape[0]
            for seq, row, epoch, fed, gate in call.decodes:
                if seq.epoch != epoch:
                    continue
                if self.config.speculative_config is not None:
                    outputs += self._collect_speculative(seq, row, sampled, call.drafted)
                    continue
                if fed < K:  # (all steps fed: the call computed forced tokens only)
                    seq.num_pending -= K - fed
                    picks = [(k, row) for k in range(fed, K)]
                    outputs += self._append_or_fail(seq, lambda: [_pick(sampled, i) for i in picks], gate)
        return outputs

    def _collect_speculative(
        self, seq: Sequence, row: int, sampled: tuple[np.ndarray, ...], drafted: bool
    ) -> list[StepOutput]:
        """One row of a speculative decode call: its valid tokens (-1 pads each step's `k + 1` slots), the positions
        the call computed (all but the last token: `num_computed`), and, for a row of a call that `drafted`, the
        acceptance counters of the steps whose tokens the request took (a step after its end is not counted)."""
        T = self.config.speculative_config.num_speculative_tokens + 1
        valid = [k for k in range(sampled[0].shape[0]) if sampled[0][k, row] >= 0]
        seq.num_pending -= self.config.decode_tokens_per_call(drafted)  # launched counted the most the call could give
        seq.spec_in_flight -= 1
        # All but the last token have K/V, and a call in flight computes what it counted (as `launched` says).
        seq.num_computed = min(len(seq.token_ids) + len(valid) - 1 + seq.num_pending, seq.max_len - 1)
        outputs = self._append_or_fail(seq, lambda: [_pick(sampled, (k, row)) for k in valid])
        if self._requests.get(seq.request_id) is seq:
            self.scheduler.settle(seq)
        if drafted and runner_drafts(seq):
            out = outputs[0] if outputs else None
            taken = 0 if out is None or out.finish_reason == "error" else len(out.new_token_ids)
            taken += out is not None and isinstance(out.stop_reason, int) and out.finish_reason == "stop"
            before = 0
            for s in range(sampled[0].shape[0] // T):
                n = int(np.sum(sampled[0][s * T : (s + 1) * T, row] >= 0))
                if n == 0 or before >= taken:
                    break
                before += n
                self._spec_counts[0] += 1
                self._spec_counts[1] += T - 1
                self._spec_counts[2] += n - 1
                for i in range(n - 1):
                    self._spec_per_pos[i] += 1
        return outputs

    def _append_or_fail(
        self, seq: Sequence, picks: Callable[[], list], gate: structured.Gate | None = None
    ) -> list[StepOutput]:
        """`_append` of one sequence's tokens; an error there (a token the stop-string check cannot decode, a
        bad value) fails that sequence only."""
        try:
            return [self._append(seq, picks(), gate)]
        except Exception as e:  # noqa: BLE001 - this request fails, the batch goes on
            return self._fail([seq], e)

    def _append(
        self,
        seq: Sequence,
        picks: list[tuple[int, float, list[tuple[int, float]]]],
        gate: structured.Gate | None = None,
    ) -> StepOutput:
        """Add sampled tokens (fed one after another on device) until a stop or length limit. A structured-output
        sequence keeps those its constraint accepts (drawn under `gate`, the call's mask for it, where that applies),
        then the tokens it forces; the dropped ones void the KV cache positions after the kept tokens (`num_computed`
        rolls back) and any call still in flight for it (`epoch`)."""
        sp = seq.params
        new, lps, reason, stop_reason = [], [], None, None
        rollback = None
        picks = picks[: seq.max_len - len(seq.token_ids)]  # past the length limit: padding steps' tokens (`useful`)
        if seq.constraint is not None:
            keep, forced = seq.constraint.accept([p[0] for p in picks], gate)
            # A rejected token, forced tokens, or a mask needed from here on (the answer nears the length limit):
            # tokens drawn without it may be in flight, so those calls are void.
            if keep < len(picks) or forced or seq.constraint.gated:
                rollback = len(seq.token_ids) + keep - 1  # the last kept token's position: computed again
            picks = picks[:keep] + [(t, 0.0, []) for t in forced]
        for tok, lp, top in picks:
            early = seq.num_output_tokens < sp.min_tokens  # stop tokens are held off (the sampler bans them too)
            if tok in sp.stop_token_ids and not early and not (sp.ignore_eos and tok in EOS_TOKEN_IDS):
                reason, stop_reason = "stop", tok
                break
            seq.token_ids.append(tok)
            new.append(tok)
            lps.append((lp, top[: sp.logprobs]))
            if sp.stop:
                stop_reason = self._stop_string(seq, tok)
                if seq.num_output_tokens < sp.min_tokens:  # and stop strings, as vLLM: until min_tokens tokens
                    stop_reason = None
                if stop_reason is not None:
                    reason = "stop"
                    break
            if len(seq.token_ids) >= seq.max_len:
                reason = "length"
                break
        self._generation_tokens += len(new)
        if reason is None and rollback is not None:
            seq.num_computed, seq.num_pending, seq.spec_in_flight = min(seq.num_computed, rollback), 0, 0
            seq.epoch += 1
        if reason is None:
            self.kv.register(seq.pages, seq.token_ids, seq.num_computed)  # pages its new tokens completed
        else:
            self.scheduler.remove(seq)
            del self._requests[seq.request_id]
        return StepOutput(
            seq.request_id,
            new,
            reason is not None,
            reason,
            stop_reason,
            lps if sp.logprobs is not None else None,
            seq.num_prompt_tokens,
            seq.num_cached_prompt_tokens,
        )

    def _stop_string(self, seq: Sequence, tok: int) -> str | None:
        before = len(seq.text_bytes.decode("utf-8", errors="replace"))
        seq.text_bytes += self.tokenizer.decode_single_token_bytes(tok)
        found = find_stop_string(seq.text_bytes.decode("utf-8", errors="replace"), seq.params.stop, before)
        return found[1] if found else None

    def warmup(self) -> None:
        """Compile every (batch, tokens, block-table width) bucket now (`ModelRunner.warmup`): logged program by
        program, a progress bar with `progress`, and `on_progress` told."""
        t0, n = time.perf_counter(), len(self.runner.buckets())
        bar = tqdm(total=n, desc="Compiling", unit="program", disable=not self._progress_bar)

        def report(stage, done, total, detail):
            if stage == "compiling":
                bar.update(done - bar.n)
                log.info("warm-up: compiled %d/%d programs (%s)", done, total, detail)
            self._report(stage, done, total, detail)

        with bar:
            self.runner.warmup(report)
        log.info(
            "warm-up: %d programs ready in %.1fs (compilation cache: %s)",
            n,
            time.perf_counter() - t0,
            self.compile_cache_dir or "off",
        )

    def _report(self, stage: str, done: int, total: int, detail: str) -> None:
        if self._on_progress is not None:
            self._on_progress(stage, done, total, detail)

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
                result = self.runner.run(step_fn, *self.runner.prompt_chunk(probe, start, n))
                out.append((result, n))
                self.kv.slide(pages, start + n)
        finally:
            self.kv.free(pages)
        return out

    def prompt_logits(self, token_ids: Seq[int]) -> np.ndarray:
        """Logits `[len, vocab]` (fp32) at every position of one prompt, computed through the paged cache
        in prefill chunks."""
        step = functools.partial(steps.prompt_logits, st=self.runner.st)
        return np.concatenate([np.asarray(lg[0, :n], np.float32) for lg, n in self.run_prompt(token_ids, step)])


def _to_host(s: Sampled, with_logprobs: bool) -> tuple[np.ndarray, ...]:
    if with_logprobs:
        return tuple(np.asarray(a) for a in (s.tokens, s.logprob, s.top_ids, s.top_lps))
    return (np.asarray(s.tokens),)


def _pick(sampled: tuple[np.ndarray, ...], index: tuple[int, ...]) -> tuple[int, float, list[tuple[int, float]]]:
    if len(sampled) == 1:
        return int(sampled[0][index]), 0.0, []
    tokens, lp, ids, vals = sampled
    return int(tokens[index]), float(lp[index]), [(int(i), float(v)) for i, v in zip(ids[index], vals[index])]
