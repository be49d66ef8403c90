"""Paged KV-cache bookkeeping on the host: page pools with reference counts, prefix caching, and each
sequence's block tables for the two layer types (docs/engine.md, "Cache layout").

Full-attention layers keep every page of a sequence; their pages are content-hashed when full so a
later request with the same prefix shares them (reference counts). Sliding layers only ever read the
last `window` positions: pages that fall out of the window go straight back to the pool, which is
sized up front (`sliding_pool_pages`) for `max_num_seqs` decoding sequences and one prefill call's
chunks, so only the full pool can run out.
"""

from __future__ import annotations

import collections
import dataclasses
import math

from gptoss_jax.engine_config import EngineConfig
from gptoss_jax.model import NULL_PAGE


class OutOfPages(RuntimeError):
    """The pool has no free or evictable page left (the scheduler preempts before this happens)."""


class PagePool:
    """Page ids `1..num_pages-1` (page 0 is the null page) with reference counts.

    With prefix caching, a full page is registered under the hash of its tokens and its prefix; when
    its last reference goes it stays readable in an LRU of evictable pages until a new allocation
    needs it, so a later request can revive it with `share`.
    """

    def __init__(self, num_pages: int, enable_prefix_caching: bool = False):
        if num_pages < 2:
            raise ValueError(f"a page pool needs at least 2 pages (one is the null page), got {num_pages}")
        self.num_pages = num_pages
        self.caching = enable_prefix_caching
        self._free = collections.deque(range(1, num_pages))
        self._refs = [0] * num_pages
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._page_of_hash: dict[int, int] = {}
        self._hash_of_page: dict[int, int] = {}

    @property
    def num_available(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - self.num_available

    def allocate(self) -> int:
        if self._free:
            page = self._free.popleft()
        elif self._evictable:
            page, _ = self._evictable.popitem(last=False)
            del self._page_of_hash[self._hash_of_page.pop(page)]
        else:
            raise OutOfPages("KV cache page pool exhausted")
        self._refs[page] = 1
        return page

    def share(self, page: int) -> None:
        if self._refs[page] == 0:
            del self._evictable[page]
        self._refs[page] += 1

    def release(self, page: int) -> None:
        if page == NULL_PAGE:
            return
        self._refs[page] -= 1
        assert self._refs[page] >= 0, f"page {page} released twice"
        if self._refs[page] == 0:
            if page in self._hash_of_page:
                self._evictable[page] = None
            else:
                self._free.append(page)

    def lookup(self, block_hash: int) -> int | None:
        return self._page_of_hash.get(block_hash) if self.caching else None

    def register(self, page: int, block_hash: int) -> None:
        if self.caching and block_hash not in self._page_of_hash and page not in self._hash_of_page:
            self._page_of_hash[block_hash] = page
            self._hash_of_page[page] = block_hash


def extend_hashes(hashes: list[int], token_ids: list[int], page_size: int, num_pages: int) -> None:
    """Chain-hash pages up to `num_pages`: equal hashes mean equal tokens and an equal prefix."""
    while len(hashes) < num_pages:
        i = len(hashes)
        hashes.append(hash((hashes[-1] if hashes else 0, tuple(token_ids[i * page_size : (i + 1) * page_size]))))


@dataclasses.dataclass
class SequencePages:
    """One sequence's block tables: entry `i` holds positions `[i*S, (i+1)*S)`. Sliding entries outside
    the window are `NULL_PAGE`."""

    full: list[int] = dataclasses.field(default_factory=list)
    sliding: list[int] = dataclasses.field(default_factory=list)
    hashes: list[int] = dataclasses.field(default_factory=list)  # of leading full pages (prefix caching)
    num_registered: int = 0  # leading full pages already offered to the prefix cache
    sliding_start: int = 0  # sliding entries before this are all NULL_PAGE (slide() skips them)
    rank: int = 0  # the attention rank whose pool holds these pages (ids are rank-local)


class KVCacheManager:
    """Both pools and the per-sequence page operations the scheduler needs (one attention rank)."""

    num_ranks = 1

    def __init__(
        self,
        num_pages_full: int,
        num_pages_sliding: int,
        page_size: int,
        window: int,
        num_sliding_layers: int,
        enable_prefix_caching: bool,
    ):
        self.page_size = page_size
        self.window = window
        self.num_sliding_layers = num_sliding_layers
        self.full = PagePool(num_pages_full, enable_prefix_caching)
        self.sliding = PagePool(num_pages_sliding)

    @property
    def capacity_tokens(self) -> int:
        return (self.full.num_pages - 1) * self.page_size

    def usage(self) -> float:
        return self.full.num_used / (self.full.num_pages - 1)

    def match_prefix(self, pages: SequencePages, token_ids: list[int]) -> tuple[int, int]:
        """Share the longest cached run of full pages of `token_ids` (leaving at least one token to
        compute). Returns `(first position to compute, first position whose full-layer K/V is new)`.

        Sliding layers are not cached, so their last window before the hit is recomputed, from far
        enough back that every sliding layer's K/V is exact again: each sliding layer widens the
        dependency cone by `window - 1` positions.
        """
        if not self.full.caching:
            return 0, 0
        extend_hashes(pages.hashes, token_ids, self.page_size, (len(token_ids) - 1) // self.page_size)
        hit = 0
        for h in pages.hashes:
            page = self.full.lookup(h)
            if page is None:
                break
            self.full.share(page)
            pages.full.append(page)
            hit += self.page_size
        pages.num_registered = len(pages.full)
        if hit == 0:
            return 0, 0
        start = max(0, hit - self.num_sliding_layers * (self.window - 1))
        return start, hit

    def _sliding_range(self, first_query: int, end: int) -> range:
        return range(max(0, first_query - self.window + 1) // self.page_size, math.ceil(end / self.page_size))

    def pages_needed(self, pages: SequencePages, first_query: int, end: int) -> tuple[int, int]:
        """New (full, sliding) pages to hold positions up to `end` for queries from `first_query`."""
        full = max(0, math.ceil(end / self.page_size) - len(pages.full))
        sliding = sum(
            1 for i in self._sliding_range(first_query, end) if i >= len(pages.sliding) or pages.sliding[i] == NULL_PAGE
        )
        return full, sliding

    def can_allocate(self, pages: SequencePages, first_query: int, end: int) -> bool:
        full, sliding = self.pages_needed(pages, first_query, end)
        return full <= self.full.num_available and sliding <= self.sliding.num_available

    def allocate(self, pages: SequencePages, first_query: int, end: int) -> None:
        while len(pages.full) < math.ceil(end / self.page_size):
            pages.full.append(self.full.allocate())
        span = self._sliding_range(first_query, end)
        pages.sliding_start = min(pages.sliding_start, span.start)
        for i in span:
            while len(pages.sliding) <= i:
                pages.sliding.append(NULL_PAGE)
            if pages.sliding[i] == NULL_PAGE:
                pages.sliding[i] = self.sliding.allocate()

    def slide(self, pages: SequencePages, next_query: int) -> None:
        """Release sliding pages no query from `next_query` on can see."""
        stop = min(len(pages.sliding), max(0, next_query - self.window + 1) // self.page_size)
        for i in range(pages.sliding_start, stop):
            self.sliding.release(pages.sliding[i])
            pages.sliding[i] = NULL_PAGE
        pages.sliding_start = max(pages.sliding_start, stop)

    def register(self, pages: SequencePages, token_ids: list[int], num_computed: int) -> None:
        """Offer the full pages whose tokens are all computed to the prefix cache."""
        done = min(num_computed, len(token_ids)) // self.page_size
        if done <= pages.num_registered or not self.full.caching:
            return
        extend_hashes(pages.hashes, token_ids, self.page_size, done)
        for i in range(pages.num_registered, done):
            self.full.register(pages.full[i], pages.hashes[i])
        pages.num_registered = done

    def free(self, pages: SequencePages) -> None:
        for p in pages.full:
            self.full.release(p)
        for p in pages.sliding:
            self.sliding.release(p)
        pages.full.clear()
        pages.sliding.clear()
        pages.hashes.clear()
        pages.num_registered = pages.sliding_start = 0


class RankedKVCacheManager:
    """One `KVCacheManager` per attention rank (a device group that owns its sequences and pages, see
    docs/SCALING.md): page ids are rank-local, each rank with its own null page 0; on device rank `r`'s
    pool is pages `[r * P, (r + 1) * P)` of the pool array. Every operation goes to `pages.rank`;
    prefix caching works within a rank."""

    def __init__(self, num_ranks: int, *args, **kwargs):
        self.ranks = [KVCacheManager(*args, **kwargs) for _ in range(num_ranks)]
        self.num_ranks = num_ranks
        self.page_size, self.window = self.ranks[0].page_size, self.ranks[0].window

    @property
    def full(self) -> PagePool:  # rank 0's pool (statistics and tests of the single-rank engine)
        return self.ranks[0].full

    @property
    def capacity_tokens(self) -> int:  # a sequence lives in one rank
        return self.ranks[0].capacity_tokens

    def usage(self) -> float:
        return sum(m.full.num_used for m in self.ranks) / sum(m.full.num_pages - 1 for m in self.ranks)

    def match_prefix(self, pages, token_ids):
        return self.ranks[pages.rank].match_prefix(pages, token_ids)

    def pages_needed(self, pages, first_query, end):
        return self.ranks[pages.rank].pages_needed(pages, first_query, end)

    def can_allocate(self, pages, first_query, end):
        return self.ranks[pages.rank].can_allocate(pages, first_query, end)

    def allocate(self, pages, first_query, end):
        self.ranks[pages.rank].allocate(pages, first_query, end)

    def slide(self, pages, next_query):
        self.ranks[pages.rank].slide(pages, next_query)

    def register(self, pages, token_ids, num_computed):
        self.ranks[pages.rank].register(pages, token_ids, num_computed)

    def free(self, pages):
        self.ranks[pages.rank].free(pages)


def sliding_pool_pages(
    window: int, page_size: int, num_seqs: int, tokens_per_seq: int, call_tokens: int = 0, call_rows: int = 0
) -> int:
    """Pages of the sliding pool, null page included, for `num_seqs` sequences that each hold the window before their
    next query and `tokens_per_seq` positions from it (a decode call's), plus one prefill call's `call_tokens` new
    positions over at most `call_rows` rows (a partial page at either end of each). Pages behind the window go back at
    every launch, so this bounds what the sequences ever hold at once."""
    per_seq = math.ceil((window - 1 + tokens_per_seq) / page_size) + 1
    return num_seqs * per_seq + math.ceil(call_tokens / page_size) + 2 * call_rows + 1


def engine_sliding_pages(ec: EngineConfig, window: int) -> int:
    """The engine's sliding pool (`sliding_pool_pages`): every running sequence's window and decode call, and one
    prefill call of `max_num_batched_tokens`. Past its last known token a sequence holds a decode call's positions
    (with speculation, the call in flight's and the next's); a structured-output sequence keeps two calls' more, the
    tokens its grammar may roll back (`Scheduler._advance`)."""
    tail = ec.decode_tokens_per_call() * (2 if ec.speculative_config else 1) + 2 * ec.decode_steps_per_call
    return sliding_pool_pages(
        window, ec.page_size, ec.max_num_seqs, tail, ec.max_num_batched_tokens, ec.max_prefill_seqs
    )


def pool_sizes(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    value_bytes: float,
    num_sliding: int,
    page_size: int,
    kv_bytes: int | None,
    full_tokens: int | None,
) -> tuple[int, int]:
    """(full, sliding) pool sizes in pages, null page included: the sliding pool's `num_sliding`
    (`sliding_pool_pages`), and the full pool's `full_tokens` if given, else what is left of `kv_bytes`.
    `value_bytes`: what one cached value takes (`kv_quant.value_bytes`: an FP8 value with its share of the scale)."""
    page_bytes = math.ceil(2 * page_size * num_kv_heads * head_dim * value_bytes)  # K and V of one layer
    if full_tokens is None:
        left = kv_bytes - num_sliding * page_bytes * ((num_layers + 1) // 2)
        per_full_page = page_bytes * max(1, num_layers // 2)
        if left < 2 * per_full_page:
            raise ValueError(
                f"the KV cache budget ({kv_bytes / 2**20:.1f} MiB) does not cover the sliding-window "
                f"pages ({num_sliding}); lower max_num_seqs or max_num_batched_tokens, or raise gpu_memory_utilization"
            )
        return left // per_full_page, num_sliding
    return math.ceil(full_tokens / page_size) + 1, num_sliding


def activation_bytes(mc, ec, itemsize: int, dequantizes: bool = True) -> int:
    """Device memory to keep free for the largest step's temporaries (`EngineConfig.gpu_memory_utilization` counts
    them): an estimate of a prefill step of `max_num_batched_tokens` tokens (per token, in float32: the residual
    stream and norms, q/k/v, and `experts_per_token` expert rows of gate/up, activation and down) plus one layer's
    experts dequantised for the prefill GEMMs (not with `dequantizes` false: the parameters hold the experts in bf16
    already, `KernelConfig.moe_prefill_bf16_experts`, and count among the weights), plus the decode call's logits
    and the sampler's copies of them, and a quarter more for padded buckets and the allocator. On an H200 the 120b's
    jobs peaked at 9.2 GiB above the weights and the cache, against 10.9 GiB for the estimate (docs/BENCHMARKS.md
    §20)."""
    h, i = mc.hidden_size, mc.intermediate_size
    qkv = (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim
    per_token = 4 * (6 * h + qkv + mc.experts_per_token * (3 * i + h))
    experts = mc.num_experts * 3 * h * i * max(itemsize, 2) if dequantizes else 0
    logits = ec.max_num_seqs * ec.decode_tokens_per_call() * mc.vocab_size * 4 * 2
    return int(1.25 * (ec.max_num_batched_tokens * per_token + experts + logits))
