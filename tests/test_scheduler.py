"""The scheduler's prefill calls: their padded shape within `max_num_batched_tokens`, whole chunks beside decoding."""

import pytest

from gptoss_jax.engine_config import EngineConfig, bucket
from gptoss_jax.kv_cache import KVCacheManager, RankedKVCacheManager, engine_sliding_pages
from gptoss_jax.sampling import SamplingParams
from gptoss_jax.scheduler import Scheduler, Sequence

_CFG = dict(
    max_num_seqs=8,
    max_num_batched_tokens=64,
    prefill_chunk_size=16,
    max_prefill_seqs=8,
    min_prefill_bucket=4,
    decode_steps_per_call=2,
    page_size=4,
)


def _scheduler(ranks: int = 1, **kw) -> Scheduler:
    kv_args = (4096, 4096, 4, 8, 1, False)
    kv = KVCacheManager(*kv_args) if ranks == 1 else RankedKVCacheManager(ranks, *kv_args)
    return Scheduler(EngineConfig(**(_CFG | kw)), kv)


def _add(s: Scheduler, name: str, prompt_len: int, max_tokens: int = 8) -> None:
    s.add(Sequence(name, list(range(prompt_len)), prompt_len, SamplingParams(max_tokens=max_tokens), (0, 0), 0))
    s.waiting[-1].max_len = prompt_len + max_tokens


def _run(s: Scheduler) -> list:
    """Every step's work until all sequences finish, each step's tokens landing before the next is scheduled."""
    steps = []
    while s.waiting or s.running:
        work = s.schedule()
        assert not work.empty
        s.launched(work)
        steps.append(([(c.seq.request_id, c.seq.pages.rank, c.num_tokens) for c in work.prefills], len(work.decodes)))
        for seq in list(s.running):
            seq.token_ids += [1] * seq.num_pending
            seq.num_pending = 0
            if len(seq.token_ids) >= seq.max_len:
                s.remove(seq)
    return steps


def _padded(s: Scheduler, chunks) -> int:
    """The prefill call's tokens as `ModelRunner.prefill` pads them."""
    cfg = s.config
    per_rank = [sum(1 for _, r, _ in chunks if r == rank) for rank in range(s.kv.num_ranks)]
    rows = s.kv.num_ranks * bucket(max(per_rank), cfg.prefill_row_buckets())
    return rows * bucket(max(n for _, _, n in chunks), cfg.prefill_token_buckets())


def test_long_prompts_prefill_in_whole_chunks_beside_decoding():
    """Prompts of 4 chunks, more than run at once: every call is 4 whole chunks (64 tokens, the budget) while
    earlier sequences decode, never a remainder left by decode rows taking part of the budget, never 5 chunks
    padded to 8 rows."""
    s = _scheduler()
    for i in range(12):
        _add(s, f"r{i}", 64)
    steps = _run(s)
    calls = [chunks for chunks, _ in steps if chunks]
    assert sum(n for chunks in calls for *_, n in chunks) == 12 * 64
    assert all(_padded(s, chunks) <= 64 for chunks in calls)
    assert all(n == 16 for chunks in calls for *_, n in chunks)
    assert all(len(chunks) == 4 for chunks in calls)
    assert any(chunks and decodes >= 2 for chunks, decodes in steps)  # prefill beside decoding rows


def test_a_chunk_shrinks_to_the_room_the_padded_call_leaves():
    """Three short prompts, then a long one: the fourth row makes 4 padded rows, so the long prompt's chunk takes
    16 tokens (4 x 16 = 64), not its 24-token bucket's 32."""
    s = _scheduler(prefill_chunk_size=32)
    for i in range(3):
        _add(s, f"short{i}", 3)
    _add(s, "long", 40)
    chunks = [(c.seq.request_id, c.num_tokens) for c in s.schedule().prefills]
    assert chunks == [("short0", 3), ("short1", 3), ("short2", 3), ("long", 16)]


def test_ranked_prefill_calls_pad_each_rank_to_the_same_rows():
    """Two attention ranks: a call pads each rank's rows to the same bucket; its padded tokens stay in budget."""
    s = _scheduler(ranks=2, max_num_seqs=16)
    for i in range(20):
        _add(s, f"r{i}", 40)
    calls = [chunks for chunks, _ in _run(s) if chunks]
    assert all(_padded(s, chunks) <= 64 for chunks in calls)
    assert {r for chunks in calls for _, r, _ in chunks} == {0, 1}
    assert max(_padded(s, chunks) for chunks in calls) == 64


def test_a_budget_below_one_row_per_rank_is_refused():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=8 .* rank \(4\) of min\(min_prefill_bucket"):
        _scheduler(ranks=4, max_num_batched_tokens=8, prefill_chunk_size=8)


def test_a_step_that_preempts_admits_no_one():
    """As vLLM's scheduler: a step whose reservations preempted a sequence takes no new one from the queue (the pages
    it freed go to the sequences already running, not to a newcomer that the next step would preempt again)."""
    s = Scheduler(EngineConfig(**_CFG), KVCacheManager(40, 4096, 4, 8, 1, False))
    for i in range(10):
        _add(s, f"r{i}", 24, max_tokens=40)
    preempting_steps, finished = 0, 0
    while s.waiting or s.running:
        before, preemptions = {id(q) for q in s.running}, s.num_preemptions
        work = s.schedule()
        s.launched(work)
        if s.num_preemptions > preemptions:
            preempting_steps += 1
            assert all(id(c.seq) in before for c in work.prefills)
        for seq in list(s.running):
            seq.token_ids += [1] * seq.num_pending
            seq.num_pending = 0
            if len(seq.token_ids) >= seq.max_len:
                s.remove(seq)
                finished += 1
    assert preempting_steps > 0 and finished == 10


def test_after_a_preemption_no_more_run_than_then_until_the_queue_drains(caplog):
    """A pool too small for every running sequence's growth: after a step preempts, admissions stop at the count that
    ran after it (else each admission preempts someone whose prompt is computed again), so few preemptions happen; once
    the queue drains, the cap goes and a new burst is admitted up to `max_num_seqs`."""
    s = Scheduler(EngineConfig(**_CFG), KVCacheManager(40, 4096, 4, 8, 1, False))
    for i in range(10):
        _add(s, f"r{i}", 24, max_tokens=40)
    cap = None
    while s.waiting or s.running:
        preemptions, waiting = s.num_preemptions, bool(s.waiting)
        work = s.schedule()
        s.launched(work)
        assert cap is None or not waiting or len(s.running) <= cap
        if s.num_preemptions > preemptions:
            cap = len(s.running)
        for seq in list(s.running):
            seq.token_ids += [1] * seq.num_pending
            seq.num_pending = 0
            if len(seq.token_ids) >= seq.max_len:
                s.remove(seq)
    assert cap is not None and 0 < s.num_preemptions <= 8  # 29 without the cap
    warned = [r.getMessage() for r in caplog.records if r.name == "gptoss_jax.scheduler"]
    assert len(warned) == 1 and "KV cache full" in warned[0] and "max_num_seqs=8" in warned[0]  # once, not per step
    for i in range(8):
        _add(s, f"burst{i}", 4)
    assert len(s.schedule().prefills) == 8 and s.admission_cap is None


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_the_engines_sliding_pool_never_runs_out(prefix_caching):
    """`kv_cache.engine_sliding_pages` (each running sequence's window and decode call, plus one prefill call) holds
    a job of long chunked prompts, short ones and shared prefixes with a full pool that never fills: no sequence is
    preempted for sliding pages, and every page comes back."""
    ec = EngineConfig(**(_CFG | dict(enable_prefix_caching=prefix_caching)))
    window = 8
    sliding = engine_sliding_pages(ec, window)
    s = Scheduler(ec, KVCacheManager(4096, sliding, ec.page_size, window, 1, prefix_caching))
    peak = 0
    for i in range(24):
        _add(s, f"r{i}", [64, 3, 37, 16][i % 4], max_tokens=[9, 30, 4][i % 3])
        if i % 5 == 0:  # a repeated prompt: prefix-cache hits start mid-prompt
            s.add(Sequence(f"p{i}", list(range(64)), 64, SamplingParams(max_tokens=5), (0, 0), 69))
    while s.waiting or s.running:
        work = s.schedule()
        s.launched(work)
        peak = max(peak, s.kv.sliding.num_used)
        for seq in list(s.running):
            seq.token_ids += [1] * seq.num_pending
            seq.num_pending = 0
            if len(seq.token_ids) >= seq.max_len:
                s.remove(seq)
    assert s.num_preemptions == 0
    assert 0 < peak < sliding and s.kv.sliding.num_used == 0
