"""What the tools share: model configs by name, median timing and the ceilings a run measures beside its figures,
random weights placed as the engine places them, one engine step (decode or prefill) on synthetic paged state,
GPU trace summaries, and kernel-config variants named on the command line (`--variant`)."""

from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import functools
import glob
import gzip
import json
import math
import os
import statistics
import subprocess
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import pallas_kernels
from gptoss_jax import checkpoint, config, kv_cache, model, random_weights, sampling, speculative, steps, structured
from gptoss_jax.engine_config import EngineConfig
from gptoss_jax.sampling import SamplerState, SamplingBatch
from pallas_kernels import KernelConfig, kv_quant
from pallas_kernels import params as params_lib

PAGE = 16
# The log-probability alternatives the engine compiles its steps for (`EngineConfig.max_logprobs`): the branch
# that computes them decides whether a call blocks the host (docs/BENCHMARKS.md §4d).
NUM_TOP = EngineConfig().max_logprobs


def commit_id() -> str:
    """The commit a result is for: `GPTOSS_JAX_COMMIT` (the GPU machine's copy of the tree can report a stale
    HEAD), else git's short HEAD, else "unknown"."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return os.environ.get("GPTOSS_JAX_COMMIT") or head or "unknown"


def model_config(name: str) -> config.ModelConfig:
    """A preset name, or a config.json path (`config.load_config`)."""
    return config.load_config(name) if name.endswith(".json") else config.preset(name)


# ---- timing and ceilings -----------------------------------------------------------------------------------------


def timeit(fn: Callable[[], Any], warmup: int = 2, reps: int = 10, calls: int = 1) -> float:
    """Median seconds per call of `fn()` over `reps` rounds of `calls` calls back to back, each round ended by
    waiting for the last call's result (the earlier ones ran before it on the same stream)."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 4 << 30, **timing) -> float:
    """Device copy bandwidth in bytes/s (read + write): XLA's `x + 1` over `nbytes` of uint32."""
    x = jax.random.bits(jax.random.PRNGKey(0), (nbytes // 4,), jnp.uint32)
    inc = jax.jit(lambda a: a + 1)
    return 2 * x.nbytes / timeit(lambda: inc(x), **timing)


def matmul_rate(n: int = 8192, **timing) -> float:
    """bf16 matmul rate in FLOP/s: XLA's `n x n` by `n x n` product, accumulated in f32."""
    a, b = (jax.random.normal(jax.random.PRNGKey(i), (n, n), jnp.float32).astype(jnp.bfloat16) for i in (1, 2))
    mm = jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    return 2 * n**3 / timeit(lambda: mm(a, b), **timing)


def torch_copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """`copy_bandwidth` by torch's `copy_` (often the higher figure). torch is optional: ImportError without it."""
    import torch  # optional, so imported where it is used

    words = nbytes // 4
    t = _torch_time(
        lambda src, dst: dst.copy_(src),
        torch.empty(words, dtype=torch.int32, device="cuda").random_(),
        torch.empty(words, dtype=torch.int32, device="cuda"),
    )
    torch.cuda.empty_cache()  # the buffers died with the call: hand their memory back
    return 2 * nbytes / t


def torch_matmul_rate(n: int = 8192) -> float:
    """`matmul_rate` by torch (cuBLAS)."""
    import torch

    t = _torch_time(lambda m: m @ m, torch.randn(n, n, device="cuda", dtype=torch.bfloat16))
    torch.cuda.empty_cache()
    return 2 * n**3 / t


def _torch_time(fn, *args, warmup: int = 3, reps: int = 5, calls: int = 10) -> float:
    """Median seconds per call of `fn(*args)` by CUDA events, over `reps` rounds of `calls` calls."""
    import torch

    for _ in range(warmup):
        fn(*args)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(calls):
            fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls / 1e3)
    return statistics.median(times)


def decode_bytes(cfg: config.ModelConfig, batch: int, context: int, kv_value_bytes: float = 2.0) -> float:
    """Fewest bytes one decode step must read: non-expert weights, the distinct routed experts (expected count
    for uniform routing), the unembedding, and the visible KV cache (`kv_value_bytes` a cached value: 2 for bf16,
    `kv_quant.value_bytes` for FP8 with its share of the scales)."""
    D, I, E, k = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.experts_per_token
    H, N, K = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    attn = 2 * (D * H * (N + 2 * K) + N * H * D) + 2 * E * D
    expert = (2 * I * D + D * I) * 4.25 / 8 + 2 * (2 * I + D)
    distinct = E * (1 - (1 - k / E) ** batch)
    kv_per_tok = 2 * K * H * kv_value_bytes
    kv = sum(
        batch * kv_per_tok * (min(context, cfg.sliding_window) if cfg.is_sliding(layer) else context)
        for layer in range(cfg.num_layers)
    )
    return cfg.num_layers * (attn + distinct * expert) + 2 * cfg.vocab_size * D + kv


# ---- kernel-config variants --------------------------------------------------------------------------------------

_WORDS = {"true": True, "false": False, "null": None}  # as a YAML config file spells them


def parse_variant(spec: str, base: KernelConfig = KernelConfig()) -> tuple[str, KernelConfig]:
    """`NAME:field=value[,field=value...]` -> (NAME, `base` with those `KernelConfig` fields replaced). Values are
    Python literals (true, false and null also as a config file spells them; a bare word is a string). A field
    KernelConfig lacks, or a value it rejects, is a ValueError naming it."""
    name, _, sets = spec.partition(":")
    known = sorted(f.name for f in dataclasses.fields(KernelConfig) if f.name != "device")
    if not name:
        raise ValueError(f"--variant {spec!r}: expected NAME:field=value[,field=value...]")
    fields = {}
    for item in filter(None, sets.split(",")):
        key, eq, text = (s.strip() for s in item.partition("="))
        if not eq:
            raise ValueError(f"--variant {spec!r}: {item!r} is not field=value")
        if key not in known:
            raise ValueError(f"--variant {spec!r}: KernelConfig has no field {key!r} (fields: {', '.join(known)})")
        fields[key] = _literal(text)
    try:
        return name, dataclasses.replace(base, **fields)
    except ValueError as e:
        raise ValueError(f"--variant {spec!r}: {e}") from None


def _literal(text: str) -> Any:
    if text.lower() in _WORDS:
        return _WORDS[text.lower()]
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        if text.isidentifier():
            return text
        raise ValueError(f"{text!r} is not a Python literal") from None


def parse_variants(ap: argparse.ArgumentParser, specs: list[str], base: KernelConfig) -> list[tuple[str, KernelConfig]]:
    """`parse_variant` of each spec; a bad one ends the program with the parser's usage error."""
    try:
        return [parse_variant(s, base) for s in specs]
    except ValueError as e:
        ap.error(str(e))


def resolved(kernels: KernelConfig) -> KernelConfig:
    """`kernels` resolved for the device (kept if it names one already, e.g. `for_device(H200)`)."""
    return kernels if kernels.device is not None else kernels.for_device()


# ---- random weights ----------------------------------------------------------------------------------------------


def param_shapes(cfg, impl: str, dtype=jnp.bfloat16, layout=None) -> params_lib.Params:
    """Every parameter as a `jax.ShapeDtypeStruct`, the experts in `impl`'s layout; under `layout`
    (`sharding.rules.Layout`) the experts padded to its `model` axis and every leaf carrying its sharding."""
    shapes = checkpoint.device_shapes(cfg, dtype, impl)
    if layout is None:
        return shapes
    shapes = layout.padded_shapes(shapes)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        shapes,
        layout.param_shardings(cfg.num_kv_heads, shapes),
    )


def random_params(cfg, kernels: KernelConfig, dtype=jnp.bfloat16, layout=None, seed: int = 0) -> params_lib.Params:
    """Random weights at `cfg`'s shape made on device in the layout `kernels` read (no checkpoint): on one device
    `random_weights.random_params`; under `layout` every leaf drawn directly in its sharded placement, the experts
    (nearly all the bytes) one program each so that temporaries never add up: MXFP4 blocks / words random bits,
    scales E8M0 near 2^-6, norms 1, other weights N(0, 0.02)."""
    if layout is None:
        return random_weights.random_params(cfg, dtype, seed, kernels=kernels)
    shapes = param_shapes(cfg, resolved(kernels).impl, dtype, layout)
    paths, structs = params_lib.field_paths(shapes), jax.tree.leaves(shapes)

    def make(ids):
        fn = lambda: [_draw(jax.random.PRNGKey(seed * 1000 + i), paths[i][-1], structs[i]) for i in ids]  # noqa: E731
        return dict(zip(ids, jax.jit(fn, out_shardings=[structs[i].sharding for i in ids])()))

    experts = [i for i, p in enumerate(paths) if p[:2] == ("layers", "experts")]
    leaves = make([i for i in range(len(paths)) if i not in experts])
    for i in experts:
        leaves.update(make([i]))
    tree = jax.tree.unflatten(jax.tree.structure(shapes), [leaves[i] for i in range(len(paths))])
    return pallas_kernels.bf16_experts(tree, resolved(kernels))  # with `moe_prefill_bf16_experts`: as the engine


def _draw(key, name: str, s):
    if name.endswith(("_blocks", "_words")):
        return jax.random.bits(key, s.shape, s.dtype)
    if name.endswith("_scales"):
        return jax.random.randint(key, s.shape, 119, 124, jnp.int32).astype(jnp.uint8)
    if name in ("attn_norm", "mlp_norm", "final_norm"):
        return jnp.ones(s.shape, s.dtype)
    return (0.02 * jax.random.normal(key, s.shape, jnp.float32)).astype(s.dtype)


# ---- one engine step on synthetic paged state --------------------------------------------------------------------


@dataclasses.dataclass
class Step:
    """A compiled engine step (`steps.decode` or `steps.prefill`) with its inputs: arrays on the device(s), or
    `jax.ShapeDtypeStruct`s carrying their shardings (then it can only be lowered). The cache is donated: each
    call takes the last call's."""

    fn: Callable
    params: Any
    cache: model.PagedKVCache
    batch: steps.DecodeBatch | steps.PrefillBatch
    st: steps.StepConfig
    pages: tuple[int, int]  # (full, sliding) pool pages per attention rank, null page included
    state: SamplerState  # the logits processors' (no row uses one); donated as the cache

    def __call__(self, block: bool = True) -> jax.Array:
        """One call -> its sampled tokens once they are ready (`block=False`: as soon as the call returns)."""
        out, self.cache, self.state = self.fn(self.params, self.cache, self.state, self.batch, st=self.st)
        return out.tokens.block_until_ready() if block else out.tokens

    def trace(self):
        """The step traced, not run (`jax.stages.Traced`: its `jaxpr`, `lower`)."""
        return self.fn.trace(self.params, self.cache, self.state, self.batch, st=self.st)

    def lower(self, **kw):
        """The step traced and lowered, not run (keywords of `Traced.lower`, e.g. `lowering_platforms`)."""
        return self.trace().lower(**kw)

    def free(self) -> None:
        """Free the cache's device memory now (the next step's cache may need it)."""
        for buf in jax.tree.leaves((self.cache, self.state)):
            buf.delete()


def decode_step(
    params,
    cfg,
    batch: int,
    context: int,
    kernels: KernelConfig,
    *,
    layout=None,
    num_steps: int = 1,
    num_top: int = NUM_TOP,
    temperature: float = 0.0,
    top_p: float = 1.0,
    kv_dtype=None,
    plain: bool = False,
) -> Step:
    """`steps.decode` as the engine calls it: `batch` rows (per attention rank under `layout`) at position `context`
    of their sequences, each with a token no other row has (identical rows would all route to the same experts: a
    too-cheap MoE), `num_steps` tokens per call fed back on device, greedy unless `temperature` > 0, the cache's
    pools in `kv_dtype` (default the weights' dtype; `kv_quant.FP8` with scales); `plain`: the greedy calls' program
    (`StepConfig.plain`, no sampler conditionals). `params`: arrays, or `ShapeDtypeStruct`s (then every input is one
    too, for `Step.lower`)."""
    put = _Placer.of(params, layout)
    cache, tables, pages = _paged_state(cfg, batch, context, num_steps, kv_dtype or params.embed.dtype, put)
    B = tables.full_BM.shape[0]
    if B > cfg.vocab_size:
        raise ValueError(f"{B} rows need distinct tokens; the vocabulary has {cfg.vocab_size}")
    tokens_B = np.random.default_rng(B).choice(cfg.vocab_size, B, replace=False).astype(np.int32)
    inputs = steps.DecodeBatch(
        put(tokens_B),
        put(np.full(B, context, np.int32)),
        tables,
        _sampling(put, B, cfg.vocab_size, temperature, top_p),
        put(np.full((B, num_steps), -1, np.int32)),
        put(np.full(B, 2**31 - 1, np.int32)),  # no length limit: every step runs
    )
    st = steps.StepConfig(cfg, resolved(kernels), layout, num_top=num_top, num_steps=num_steps, plain=plain)
    return Step(steps.decode, params, cache, inputs, st, pages, _sampler_state(put, cfg, B))


def speculative_step(
    params,
    cfg,
    batch: int,
    context: int,
    kernels: KernelConfig,
    drafter,
    *,
    num_steps: int = 1,
    draft_params=None,
    draft: bool = True,
    plain: bool = False,
) -> Step:
    """`steps.decode_speculative` as the engine calls it with `drafter` (`speculative.make_drafter`): `batch` greedy
    rows at position `context`, every row drafting, each verify step `drafter.num_tokens + 1` tokens (`draft=False`:
    the step of a call with more requests enqueued than `disable_by_batch_size`, one token per row; `plain`: the greedy
    calls' program); the drafter's history holds random tokens up to the position. One device."""
    put = _Placer.of(params, None)
    T = num_steps * (drafter.num_tokens + 1)
    cache, tables, pages = _paged_state(cfg, batch, context, T, params.embed.dtype, put)
    tokens_B = np.random.default_rng(batch).choice(cfg.vocab_size, batch, replace=False).astype(np.int32)
    decode = steps.DecodeBatch(
        put(tokens_B),
        put(np.full(batch, context, np.int32)),
        tables,
        _sampling(put, batch, cfg.vocab_size),
        put(np.full((batch, num_steps), -1, np.int32)),
        put(np.full(batch, 2**31 - 1, np.int32)),  # no length limit: every step runs
    )
    proc = np.zeros((batch, 4), np.int32)
    proc[:, 3] = np.arange(batch)  # each row its own slot of the drafter's history
    decode = decode.replace(sampling=decode.sampling.replace(proc_B4=put(proc)))
    history = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch + 1, drafter.history_tokens), np.int32)
    history_state = speculative.DraftState(
        put(history), put(np.zeros(batch + 1, np.int32)), put(np.zeros(batch + 1, np.int32))
    )
    state = (_sampler_state(put, cfg, batch), history_state)
    st = steps.StepConfig(
        cfg, resolved(kernels), None, num_top=NUM_TOP, num_steps=num_steps, drafter=drafter, draft=draft, plain=plain
    )
    batch_ = steps.SpeculativeBatch(decode, put(np.ones(batch, bool)), put(np.zeros(batch, bool)))
    return Step(steps.decode_speculative, (params, draft_params), cache, batch_, st, pages, state)


def prefill_step(
    params,
    cfg,
    rows: int,
    tokens: int,
    kernels: KernelConfig,
    *,
    start: int = 0,
    layout=None,
    num_top: int = NUM_TOP,
    kv_dtype=None,
) -> Step:
    """`steps.prefill` of `rows` chunks (per attention rank under `layout`) of `tokens` random prompt tokens at
    positions `start ..< start + tokens`, each sampling (greedy) the token after its last; `params` and `kv_dtype`
    as in `decode_step`."""
    put = _Placer.of(params, layout)
    cache, tables, pages = _paged_state(cfg, rows, start, tokens, kv_dtype or params.embed.dtype, put)
    B = tables.full_BM.shape[0]
    tokens_BT = np.random.default_rng(tokens).integers(0, cfg.vocab_size, (B, tokens), dtype=np.int32)
    positions_BT = np.tile(np.arange(start, start + tokens, dtype=np.int32), (B, 1))
    inputs = steps.PrefillBatch(
        put(tokens_BT),
        put(positions_BT),
        tables,
        put(np.full(B, tokens - 1, np.int32)),
        _sampling(put, B, cfg.vocab_size),
        jax.tree.map(put, sampling.empty_lists(B, cfg.vocab_size)),
    )
    st = steps.StepConfig(cfg, resolved(kernels), layout, num_top)
    return Step(steps.prefill, params, cache, inputs, st, pages, _sampler_state(put, cfg, B))


@dataclasses.dataclass(frozen=True)
class _Placer:
    """Host batch arrays -> device arrays (rows split over the attention ranks under `layout`), or their
    `ShapeDtypeStruct`s where the step is `abstract`."""

    layout: Any
    abstract: bool

    @classmethod
    def of(cls, params, layout) -> _Placer:
        return cls(layout, isinstance(jax.tree.leaves(params)[0], jax.ShapeDtypeStruct))

    def __call__(self, x: np.ndarray):
        where = None if self.layout is None else self.layout.named(self.layout.batch_spec(x.ndim))
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where) if self.abstract else jax.device_put(x, where)


def _paged_state(cfg, rows: int, start: int, tokens: int, dtype, put: _Placer):
    """A KV cache and page tables for `rows` rows (per attention rank) whose new tokens sit at positions
    `start ..< start + tokens`, laid out as the engine lays them out (no prefill needed): each row its own
    full-layer pages up to its last new token; sliding-layer pages only from the window before `start` on (earlier
    columns on the null page), reused cyclically within the row's share of a pool that holds each row's window and
    new tokens (`kv_cache.sliding_pool_pages`). Page ids are rank-local.
    -> (cache, tables, (full, sliding) pages per rank)."""
    layout = put.layout
    R = layout.num_ranks if layout is not None else 1
    M = math.ceil((start + tokens) / PAGE)
    n_full, n_sliding = kv_cache.pool_sizes(
        cfg.num_layers,
        cfg.num_kv_heads,
        cfg.head_dim,
        kv_quant.value_bytes(dtype, cfg.head_dim),
        kv_cache.sliding_pool_pages(cfg.sliding_window, PAGE, rows, tokens),
        PAGE,
        None,
        rows * M * PAGE,
    )
    per_row = (n_sliding - 1) // rows
    row_B1 = (np.arange(R * rows) % rows)[:, None]  # rank-local row (rows are rank-major)
    col_1M = np.arange(M)[None]
    full_BM = (1 + row_B1 * M + col_1M).astype(np.int32)
    first = max(0, (start - cfg.sliding_window) // PAGE)
    sliding_BM = np.where(col_1M >= first, 1 + row_B1 * per_row + col_1M % per_row, 0).astype(np.int32)
    zeros = lambda: model.PagedKVCache.zeros(cfg, R * n_sliding, R * n_full, PAGE, dtype)  # noqa: E731
    shapes = jax.eval_shape(zeros)
    where = None if layout is None else layout.cache_shardings(shapes, cfg.num_kv_heads)
    if put.abstract:
        place = lambda s, w: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=w)  # noqa: E731
        cache = shapes if where is None else jax.tree.map(place, shapes, where)
    else:
        cache = zeros() if where is None else jax.jit(zeros, out_shardings=where)()
    tables = model.PageTables(put(sliding_BM), put(full_BM), put(np.zeros(R * rows, np.int32)))
    return cache, tables, (n_full, n_sliding)


def _sampling(put, B: int, vocab: int, temperature: float = 0.0, top_p: float = 1.0) -> SamplingBatch:
    f32 = np.float32
    proc = np.zeros((B, 4), np.int32)  # no logits processor; every row on the state's spare slot
    proc[:, 3] = B
    return SamplingBatch(
        put(np.full(B, temperature, f32)),
        put(np.zeros(B, np.int32)),
        put(np.full(B, top_p, f32)),
        put(np.zeros(B, f32)),
        put(np.zeros((B, 2), np.uint32)),
        put(np.zeros(B, bool)),
        put(np.zeros(B, bool)),
        put(np.zeros((B, structured.mask_words(vocab)), np.int32)),
        put(np.zeros(B, np.int32)),
        put(np.zeros(B, bool)),
        put(np.tile(np.array([0, 0, 1], f32), (B, 1))),
        put(proc),
    )


def _sampler_state(put: _Placer, cfg, B: int) -> SamplerState:
    """The engine's per-slot logits-processor state for `B` sequences (and the spare slot), the same on every
    device, as the engine keeps it."""
    zeros = functools.partial(SamplerState.zeros, B + 1, cfg.vocab_size)
    where = None if put.layout is None else put.layout.named(P())
    if put.abstract:
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where), jax.eval_shape(zeros))
    return jax.jit(zeros, out_shardings=where)()


# ---- profiler traces ---------------------------------------------------------------------------------------------


def perfetto_events(trace_dir: str) -> tuple[list[dict], dict]:
    """The newest perfetto trace `jax.profiler` wrote under `trace_dir`: (its events, process id -> name)."""
    path = sorted(glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True))[-1]
    events = json.load(gzip.open(path))["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    return events, procs


def summarize_trace(trace_dir: str, top: int = 60, timeline: int = 0) -> dict:
    """GPU kernel time from the perfetto trace `jax.profiler` wrote under `trace_dir`, per stream: events, span,
    busy time (the union of the kernels' intervals), the `top` kernels by total time, and the idle time between
    kernels by the pair of kernels around each gap (the largest ten: where the stream waits); with `timeline`, also
    that many consecutive kernels from the middle of the busiest stream: start (from the first), duration and the
    gap since the previous kernel ended (negative: they overlapped), which show where the step waits."""
    events, procs = perfetto_events(trace_dir)
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "GPU" in procs.get(e["pid"], "") and "dur" in e:
            by_thread[threads.get((e["pid"], e["tid"]), str(e["tid"]))].append(e)
    out = {}
    for name, evs in by_thread.items():
        evs.sort(key=lambda e: e["ts"])
        busy, end, last = 0.0, -1e30, ""
        idle, idle_n = collections.Counter(), collections.Counter()
        for e in evs:  # union of intervals
            s, f = e["ts"], e["ts"] + e["dur"]
            if end > -1e30 and s > end:
                idle[(last, e["name"][:60])] += s - end
                idle_n[(last, e["name"][:60])] += 1
            busy += max(0.0, f - max(s, end))
            if f >= end:
                end, last = f, e["name"][:60]
        totals, counts, args = collections.Counter(), collections.Counter(), {}
        for e in evs:
            totals[e["name"][:120]] += e["dur"]
            counts[e["name"][:120]] += 1
            args.setdefault(e["name"][:120], str(e.get("args", ""))[:300])
        out[name] = {
            "events": len(evs),
            "span_us": end - evs[0]["ts"],
            "busy_us": busy,
            "top": [{"name": n, "us": t, "count": counts[n], "args": args[n]} for n, t in totals.most_common(top)],
            "gaps": [{"after": a, "before": b, "us": t, "count": idle_n[a, b]} for (a, b), t in idle.most_common(10)],
        }
    if timeline and out:
        name = max(out, key=lambda n: out[n]["busy_us"])
        evs = by_thread[name][len(by_thread[name]) // 2 :][:timeline]
        ends = [e["ts"] + e["dur"] for e in evs]
        out[name]["timeline"] = [
            {
                "name": e["name"][:60],
                "start_us": round(e["ts"] - evs[0]["ts"], 2),
                "dur_us": e["dur"],
                "gap_us": round(e["ts"] - max(ends[:i]), 2) if i else 0.0,
            }
            for i, e in enumerate(evs)
        ]
    return out
