"""Continuous batching: which sequences compute which tokens in the next engine step.

Each step runs every decoding sequence (one token, or `decode_steps_per_call` on device) in one call and
fills a prefill call with chunks: partly prefilled sequences first, then new ones admitted from the waiting queue
while pages, the sequence limit and the budget allow. The budget bounds the prefill call as it will run, padded
(rows per attention rank and chunk length rounded up to their buckets, `ModelRunner.prefill`) to at most
`max_num_batched_tokens`: padding costs what real tokens cost, and the activation reserve is sized for that many. A
long prompt therefore advances a chunk per step while everyone else keeps decoding. When the full-layer pool
runs dry, the newest running sequence is preempted: its pages are freed and it goes back to the
front of the queue to be recomputed later (its tokens and seeds are kept, so its output is the same); as in vLLM, a
step that preempted admits no new sequence. Unlike vLLM, no more sequences then run than ran after that step until the
waiting queue drains (`admission_cap`): long prompts at a `max_num_seqs` the pool cannot hold otherwise thrash, each
admission preempting a sequence whose prompt is computed again (BENCHMARKS §19).

A step is scheduled before the previous step's tokens reach the host (async scheduling): `launched`
marks what a dispatched call will compute and sample (`num_pending` tokens still on device), so the
next decode of a sequence feeds its pending last token from the device. Work for a sequence that
turns out to have finished, or was preempted, is dropped when its results arrive (`epoch`). With speculative
decoding a decode call computes a number of positions known only when it is read: `launched` counts the most it
can (pages are reserved for that), the device keeps each sequence's next position and token, and the engine
corrects the counts when it reads the call (`settle`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any

from gptoss_jax.engine_config import EngineConfig, padded_rows
from gptoss_jax.kv_cache import KVCacheManager, SequencePages
from gptoss_jax.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Sequence:
    """One request's tokens and progress. `num_computed` tokens have K/V in the cache; the rest (at
    least the last token) still have to run through the model."""

    request_id: str
    token_ids: list[int]  # prompt, then generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    key: tuple[int, int]  # PRNG key data; token at position p is drawn with fold_in(key, p - 1)
    max_len: int  # total tokens at which the request ends with "length"
    pages: SequencePages = dataclasses.field(default_factory=SequencePages)
    num_computed: int = 0  # positions whose K/V a dispatched call writes
    num_pending: int = 0  # tokens sampled by dispatched calls, not yet in token_ids (with speculation: at most)
    spec_in_flight: int = 0  # speculative decode calls in flight: its next position and token are the device's
    slot: int = -1  # its entry in the engine's on-device last-token table
    epoch: int = 0  # bumped when it leaves the running batch: in-flight work is void
    full_cached: int = 0  # positions below come from prefix-cached full-layer pages
    num_cached_prompt_tokens: int = 0  # prompt tokens skipped thanks to the prefix cache
    text_bytes: bytearray = dataclasses.field(default_factory=bytearray)  # for stop strings
    constraint: Any = None  # `structured.Constraint` of a structured-output request
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # `params.bad_words` tokenized (the engine does it)
    feeds_forced: bool = True  # forced tokens go to its decode calls (not under speculation: its step takes none)

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) + self.num_pending - self.num_computed

    def decode_span(self, steps: int) -> tuple[int, int]:
        """(first query position, end of the K/V positions to hold) of its next decode call: after its last token,
        or, with nothing in flight, from its first uncomputed one (tokens the host fed: `fed_tokens`)."""
        first = self.num_computed if not self.num_pending else len(self.token_ids) + self.num_pending - 1
        return first, min(first + steps, self.max_len - 1)

    @property
    def fed_tokens(self) -> int:
        """Decode inputs the host gives its next call: 1, or, after tokens forced onto a generated sequence (a
        structured output's), those tokens one per step, so that they need no prefill call."""
        u = self.num_uncomputed
        after_prompt = self.num_computed >= self.num_prompt_tokens - 1
        return u if u > 1 and self.feeds_forced and not self.num_pending and after_prompt else 1

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclasses.dataclass
class PrefillChunk:
    seq: Sequence
    start: int
    num_tokens: int


@dataclasses.dataclass
class SchedulerOutput:
    prefills: list[PrefillChunk]
    decodes: list[Sequence]

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager):
        smallest = kv.num_ranks * config.prefill_token_buckets()[0]
        if smallest > config.max_num_batched_tokens:
            raise ValueError(
                f"max_num_batched_tokens={config.max_num_batched_tokens} is below the smallest prefill call: one "
                f"row per attention rank ({kv.num_ranks}) of min(min_prefill_bucket, prefill_chunk_size)="
                f"{config.prefill_token_buckets()[0]} tokens; raise max_num_batched_tokens or lower min_prefill_bucket"
            )
        self.config = config
        self.kv = kv
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # in admission order, oldest first
        self.num_preemptions = 0
        # After a step preempts, no more sequences run than ran after it, until the queue drains: the pool showed what
        # it holds of this traffic, and admitting past it makes every admission cost a preempted sequence's prompt.
        self.admission_cap: int | None = None
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence, cache: bool = True) -> None:
        """Drop a finished or aborted sequence and free its pages (full ones stay prefix-cached unless `cache` is
        False: a failed sequence's pages may hold half-written K/V)."""
        if seq in self.running:
            self._leave(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if cache:
            self.kv.register(seq.pages, seq.token_ids, seq.num_computed)
        self.kv.free(seq.pages)

    def _leave(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free_slots.append(seq.slot)
        seq.slot, seq.num_pending, seq.spec_in_flight = -1, 0, 0
        seq.epoch += 1

    def schedule(self, drafts: bool = True) -> SchedulerOutput:
        """This step's work. `drafts`: whether its decode call drafts (with speculation): a call that does not computes
        one position per step, so requests near their end are not held back for the most a drafting call gives."""
        cfg = self.config
        preemptions = self.num_preemptions
        if not self.waiting:
            self.admission_cap = None
        most_running = min(cfg.max_num_seqs, self.admission_cap or cfg.max_num_seqs)
        scheduled: set[int] = set()
        decodes: list[Sequence] = []
        for seq in list(self.running):
            if seq not in self.running:
                continue
            first, end = seq.decode_span(cfg.decode_tokens_per_call(drafts))
            if seq.num_pending and end <= first:  # its last tokens are in flight: it ends by length
                scheduled.add(id(seq))  # when they land, so no reservation may preempt it
                continue
            if seq.num_uncomputed != seq.fed_tokens:
                continue  # a prompt (or what preemption left) to prefill
            if self._reserve(seq, first, end, scheduled):
                decodes.append(seq)
                scheduled.add(id(seq))

        prefills: list[PrefillChunk] = []
        for seq in list(self.running):
            if len(prefills) == cfg.max_prefill_seqs:
                break
            if seq not in self.running or id(seq) in scheduled or seq.num_pending:
                continue
            room = self._chunk_room(prefills, seq.pages.rank)
            if room == 0:
                break
            n = min(seq.num_uncomputed, room)
            if self._reserve(seq, seq.num_computed, seq.num_computed + n, scheduled):
                prefills.append(PrefillChunk(seq, seq.num_computed, n))
                scheduled.add(id(seq))

        while (
            self.waiting
            and self.num_preemptions == preemptions
            and len(prefills) < cfg.max_prefill_seqs
            and len(self.running) < most_running
        ):
            seq = self.waiting[0]
            rank = self._pick_rank()
            if rank is None:
                break
            room = self._chunk_room(prefills, rank)
            if room == 0:
                break
            seq.pages.rank = rank
            # The sampler rebuilds what penalties and bad words read from the sequence's prefill, from position 0.
            start, hit = (0, 0) if seq.params.needs_history else self.kv.match_prefix(seq.pages, seq.token_ids)
            n = min(len(seq.token_ids) - start, room)
            if not self.kv.can_allocate(seq.pages, start, start + n):
                self.kv.free(seq.pages)  # give the shared prefix back; retry next step
                break
            self.kv.allocate(seq.pages, start, start + n)
            self.waiting.popleft()
            self.running.append(seq)
            seq.slot = self._free_slots.pop()
            seq.num_computed, seq.full_cached = start, hit
            if seq.num_output_tokens == 0:
                seq.num_cached_prompt_tokens = start
            prefills.append(PrefillChunk(seq, start, n))
            scheduled.add(id(seq))
        if self.num_preemptions > preemptions:
            if self.admission_cap is None:
                log.warning(
                    "KV cache full: %d sequence(s) preempted (to be recomputed); until the %d waiting drain, at most "
                    "%d run (max_num_seqs=%d). More fit with a larger gpu_memory_utilization or kv_cache_dtype: fp8",
                    self.num_preemptions - preemptions,
                    len(self.waiting),
                    max(1, len(self.running)),
                    cfg.max_num_seqs,
                )
            self.admission_cap = max(1, len(self.running))
        return SchedulerOutput(prefills, decodes)

    def _chunk_room(self, prefills: list[PrefillChunk], rank: int) -> int:
        """The most tokens a chunk of a sequence on attention rank `rank` may add to a prefill call of `prefills`
        (0: none): at most `prefill_chunk_size`, and the call padded as `ModelRunner.prefill` pads it (each rank's rows
        to the same row bucket, every chunk to the longest one's token bucket) within `max_num_batched_tokens`."""
        cfg = self.config
        per_rank = [0] * self.kv.num_ranks
        for r in [c.seq.pages.rank for c in prefills] + [rank]:
            per_rank[r] += 1
        rows = padded_rows(per_rank, cfg.prefill_row_buckets())
        room = max((t for t in cfg.prefill_token_buckets() if rows * t <= cfg.max_num_batched_tokens), default=0)
        return room if all(c.num_tokens <= room for c in prefills) else 0

    def _reserve(self, seq: Sequence, first_query: int, end: int, scheduled: set[int]) -> bool:
        """Allocate pages for `seq`, preempting the newest unscheduled sequences if needed; preempts
        `seq` itself (returns False) when nothing else can give pages back."""
        while not self.kv.can_allocate(seq.pages, first_query, end):
            victims = [
                s for s in self.running if s is not seq and id(s) not in scheduled and s.pages.rank == seq.pages.rank
            ]  # only its own rank's pages help
            self._preempt(victims[-1] if victims else seq)
            if not victims:
                return False
        self.kv.allocate(seq.pages, first_query, end)
        return True

    def _pick_rank(self) -> int | None:
        """The attention rank a new sequence joins: the one with the most free full pages among those
        below their share of `max_num_seqs` (None: all full)."""
        R = self.kv.num_ranks
        if R == 1:
            return 0
        counts = collections.Counter(s.pages.rank for s in self.running)
        share = -(-self.config.max_num_seqs // R)
        open_ranks = [r for r in range(R) if counts[r] < share]
        if not open_ranks:
            return None
        return max(open_ranks, key=lambda r: (self.kv.ranks[r].full.num_available, -r))

    def _preempt(self, seq: Sequence) -> None:
        self._leave(seq)
        self.kv.register(seq.pages, seq.token_ids, seq.num_computed)
        self.kv.free(seq.pages)
        seq.num_computed = seq.full_cached = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def launched(self, work: SchedulerOutput, drafts: bool = True) -> None:
        """`work` is on the device: its K/V positions count as computed and its sampled tokens as
        pending. Sliding pages the window left behind go back to the pool only now, after the call that
        may still read them was enqueued (later calls run after it). `drafts` as `schedule`'s."""
        K = self.config.decode_tokens_per_call(drafts)
        for seq in work.decodes:
            _, end = seq.decode_span(K)
            if self.config.speculative_config is None:
                seq.num_pending += max(0, K + 1 - seq.fed_tokens)  # the steps after its last fed token sample
                self._advance(seq, end)
            else:  # at most K tokens: sliding pages stay for the least progress, the last token known now
                seq.num_pending += K
                seq.spec_in_flight += 1
                self._advance(seq, end, len(seq.token_ids) - 1)
        for c in work.prefills:
            if c.start + c.num_tokens == len(c.seq.token_ids):
                c.seq.num_pending += 1
            self._advance(c.seq, c.start + c.num_tokens)

    def settle(self, seq: Sequence) -> None:
        """With speculative decoding, after the engine read a decode call of `seq` and set `num_computed` from its
        true token count: release the sliding pages no call from its last known token on can see."""
        self._advance(seq, seq.num_computed, len(seq.token_ids) - 1)

    def _advance(self, seq: Sequence, num_computed: int, next_query: int | None = None) -> None:
        """`num_computed` positions are (or will be, by calls in flight) computed; the sliding pages before the
        window of `next_query` (default `num_computed`), the least position a later query can have, go back."""
        seq.num_computed = num_computed
        # A structured-output sequence may drop up to two calls' tokens (its reasoning cut, an answer token the grammar
        # rejects: the engine rolls `num_computed` back): its sliding pages stay that much longer.
        margin = 2 * self.config.decode_steps_per_call if seq.constraint is not None else 0
        self.kv.slide(seq.pages, (num_computed if next_query is None else next_query) - margin)
        self.kv.register(seq.pages, seq.token_ids, num_computed)
