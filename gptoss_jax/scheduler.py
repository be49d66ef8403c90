"""Continuous batching: which sequences compute which tokens in the next engine step.

Each step runs every decoding sequence (one token, or `decode_steps_per_call` on device) and fills
the rest of the token budget with prefill chunks: partly prefilled sequences first, then new ones
admitted from the waiting queue while pages, the sequence limit and the budget allow. A long prompt
therefore advances a chunk per step while everyone else keeps decoding. When the full-layer pool
runs dry, the newest running sequence is preempted: its pages are freed and it goes back to the
front of the queue to be recomputed later (its tokens and seeds are kept, so its output is the same).
"""

from __future__ import annotations

import collections
import dataclasses

from gptoss_jax.engine_config import EngineConfig
from gptoss_jax.kv_cache import KVCacheManager, SequencePages
from gptoss_jax.sampling import SamplingParams


@dataclasses.dataclass(eq=False)
class Sequence:
    """One request's tokens and progress. `num_computed` tokens have K/V in the cache; the rest (at
    least the last token) still have to run through the model."""
    request_id: str
    token_ids: list[int]  # prompt, then generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    key: tuple[int, int]  # PRNG key data; token at position p is drawn with fold_in(key, p - 1)
    max_len: int          # total tokens at which the request ends with "length"
    pages: SequencePages = dataclasses.field(default_factory=SequencePages)
    num_computed: int = 0
    full_cached: int = 0              # positions below come from prefix-cached full-layer pages
    num_cached_prompt_tokens: int = 0  # prompt tokens skipped thanks to the prefix cache
    finished: bool = False
    text_bytes: bytearray = dataclasses.field(default_factory=bytearray)  # for stop strings

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

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
        self.config = config
        self.kv = kv
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # in admission order, oldest first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its pages (full ones stay prefix-cached)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.register(seq.pages, seq.token_ids, seq.num_computed)
        self.kv.free(seq.pages)

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: set[int] = set()
        decodes: list[Sequence] = []
        for seq in list(self.running):
            if seq not in self.running or seq.num_uncomputed != 1:
                continue
            first = len(seq.token_ids) - 1
            end = min(first + cfg.decode_steps_per_call, seq.max_len - 1)
            if self._reserve(seq, first, end, scheduled):
                decodes.append(seq)
                scheduled.add(id(seq))
                budget -= 1

        prefills: list[PrefillChunk] = []
        for seq in list(self.running):
            if budget <= 0 or len(prefills) == cfg.max_prefill_seqs:
                break
            if seq not in self.running or id(seq) in scheduled:
                continue
            n = min(seq.num_uncomputed, cfg.prefill_chunk_size, budget)
            if self._reserve(seq, seq.num_computed, seq.num_computed + n, scheduled):
                prefills.append(PrefillChunk(seq, seq.num_computed, n))
                scheduled.add(id(seq))
                budget -= n

        while (self.waiting and budget > 0 and len(prefills) < cfg.max_prefill_seqs
               and len(self.running) < cfg.max_num_seqs):
            seq = self.waiting[0]
            rank = self._pick_rank()
            if rank is None:
                break
            seq.pages.rank = rank
            start, hit = self.kv.match_prefix(seq.pages, seq.token_ids)
            n = min(len(seq.token_ids) - start, cfg.prefill_chunk_size, budget)
            if not self.kv.can_allocate(seq.pages, start, start + n):
                self.kv.free(seq.pages)  # give the shared prefix back; retry next step
                break
            self.kv.allocate(seq.pages, start, start + n)
            self.waiting.popleft()
            self.running.append(seq)
            seq.num_computed, seq.full_cached = start, hit
            if seq.num_output_tokens == 0:
                seq.num_cached_prompt_tokens = start
            prefills.append(PrefillChunk(seq, start, n))
            scheduled.add(id(seq))
            budget -= n
        return SchedulerOutput(prefills, decodes)

    def _reserve(self, seq: Sequence, first_query: int, end: int, scheduled: set[int]) -> bool:
        """Allocate pages for `seq`, preempting the newest unscheduled sequences if needed; preempts
        `seq` itself (returns False) when nothing else can give pages back."""
        while not self.kv.can_allocate(seq.pages, first_query, end):
            victims = [s for s in self.running if s is not seq and id(s) not in scheduled
                       and s.pages.rank == seq.pages.rank]  # only its own rank's pages help
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
        self.running.remove(seq)
        self.kv.register(seq.pages, seq.token_ids, seq.num_computed)
        self.kv.free(seq.pages)
        seq.num_computed = seq.full_cached = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def advance(self, seq: Sequence, num_computed: int) -> None:
        """`seq`'s first `num_computed` tokens now have K/V: drop sliding pages the window left behind
        and offer completed full pages to the prefix cache."""
        seq.num_computed = num_computed
        self.kv.slide(seq.pages, seq.num_computed)
        self.kv.register(seq.pages, seq.token_ids, seq.num_computed)
