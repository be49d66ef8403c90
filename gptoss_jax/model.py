"""The gpt-oss transformer as pure functions over `Params` (see docs/model.md for the math).

Pre-norm residual blocks, each attention (GQA, q/k/v/o biases, YaRN RoPE, learned sinks, sliding
window on even layers) followed by a top-k MXFP4 mixture of experts. Layers run as one `lax.scan`
over (sliding, full) pairs, so each attention reads its own page pool with a static window; the
paged KV cache rides in the scan carry so XLA updates it in place (docs/engine.md, "Cache layout").
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

import pallas_kernels
from gptoss_jax.config import ModelConfig
from pallas_kernels import REFERENCE, KernelConfig, attention_reference, kv_quant, layer_index, moe_reference, rope
from pallas_kernels.norm import rms_norm
from pallas_kernels.params import Params
from sharding import expert_parallel, tensor_parallel

FULL_WINDOW = 2**31 - 1
NULL_PAGE = 0  # never allocated: padded and already-cached tokens aim their writes here; never read where visible


@struct.dataclass
class Pools:
    """One layer type's pools, all its layers: K and V `[L, P, S, K, H]` in the cache dtype and, for an FP8 cache, V
    transposed within each page, `[L, P, K, H, S]`, and their per-(slot, head) scales `[L, P, K, S]`
    (`pallas_kernels.kv_quant`, which says why those orders; None otherwise)."""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

    def flat(self) -> "Pools":
        """All layers as one pool of `L * P` pages (`page_offset` finds a layer's): a reshape is free, while slicing
        a layer out would copy its whole pool into the kernel call."""
        return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), self)

    def row(self, layer) -> jax.Array:
        """This pool's `[L, ...]` row of model layer `layer` (`layer_index`), one of its type's: the types alternate."""
        return layer_index.value(layer) // 2

    def page_offset(self, layer) -> jax.Array:
        """The first page in `flat` of model layer `layer`."""
        return self.row(layer) * self.k.shape[1]

    def like(self, flat: "Pools") -> "Pools":
        """`flat` (from `flat`) in this pools' `[L, P, ...]` shape."""
        return jax.tree.map(lambda f, a: f.reshape(a.shape), flat, self)

    def scales(self) -> dict:
        """The kernels' scale arguments."""
        return dict(k_scale_PKS=self.k_scale, v_scale_PKS=self.v_scale)


@struct.dataclass
class PagedKVCache:
    """Two page pools: sliding layers (even) keep only their window's pages, full layers (odd) keep all.

    Position `p` of a sequence lives in page `table[p // page_size]`, slot `p % page_size`, of the
    pool of the layer's type. An FP8 cache (`kv_cache_dtype: fp8`) keeps a scale per (slot, KV head) beside each
    pool (`pallas_kernels.kv_quant`); the scale fields are None otherwise."""

    k_sliding: jax.Array  # [Ls, Ps, S, K, H]
    v_sliding: jax.Array  # [Ls, Ps, S, K, H]; FP8: [Ls, Ps, K, H, S]
    k_full: jax.Array  # [Lf, Pf, S, K, H]
    v_full: jax.Array  # [Lf, Pf, S, K, H]; FP8: [Lf, Pf, K, H, S]
    k_sliding_scale: jax.Array | None = None  # f32 [Ls, Ps, K, S]
    v_sliding_scale: jax.Array | None = None
    k_full_scale: jax.Array | None = None  # f32 [Lf, Pf, K, S]
    v_full_scale: jax.Array | None = None

    @classmethod
    def zeros(
        cls, cfg: ModelConfig, num_pages_sliding: int, num_pages_full: int, page_size: int, dtype
    ) -> "PagedKVCache":
        """An empty cache whose pools hold `dtype` (the model's, or `kv_quant.FP8` with scales)."""
        ls, lf = (cfg.num_layers + 1) // 2, cfg.num_layers // 2
        tail = (page_size, cfg.num_kv_heads, cfg.head_dim)
        s, f = (ls, num_pages_sliding) + tail, (lf, num_pages_full) + tail
        values = dict(v_sliding=s, v_full=f)
        scales = {}
        if kv_quant.is_quantized(dtype):
            values = {name: (*shape[:2], cfg.num_kv_heads, cfg.head_dim, page_size) for name, shape in values.items()}
            scales = {
                f"{kv}_{kind}_scale": jnp.ones((*shape[:2], cfg.num_kv_heads, page_size), jnp.float32)
                for kv in "kv"
                for kind, shape in (("sliding", s), ("full", f))
            }
        return cls(
            k_sliding=jnp.zeros(s, dtype),
            k_full=jnp.zeros(f, dtype),
            **{name: jnp.zeros(shape, dtype) for name, shape in values.items()},
            **scales,
        )

    def logical_axes(self) -> "PagedKVCache":
        """Each array's logical axes (`sharding.rules`): the pools `[layers, pages, slot, kv_heads, head_dim]`, an
        FP8 cache's values `[layers, pages, kv_heads, head_dim, slot]` and scales `[layers, pages, kv_heads, slot]`."""
        pool = ("layers", "pages", None, "kv_heads", None)
        if self.k_full_scale is None:
            return PagedKVCache(pool, pool, pool, pool)
        values, scales = ("layers", "pages", "kv_heads", None, None), ("layers", "pages", "kv_heads", None)
        return PagedKVCache(pool, values, pool, values, scales, scales, scales, scales)

    @property
    def page_size(self) -> int:
        return self.k_sliding.shape[2]

    def pools(self, sliding: bool) -> Pools:
        kind = "sliding" if sliding else "full"
        return Pools(*(getattr(self, f"{kv}_{kind}{end}") for end in ("", "_scale") for kv in "kv"))

    @classmethod
    def of(cls, sliding: Pools, full: Pools) -> "PagedKVCache":
        return cls(sliding.k, sliding.v, full.k, full.v, sliding.k_scale, sliding.v_scale, full.k_scale, full.v_scale)


@struct.dataclass
class PageTables:
    """Where one call's tokens read and write. `full_cached_B`: positions below it are already in shared
    (prefix-cached) full-layer pages, so their full-layer writes go to the null page."""

    sliding_BM: jax.Array  # int32 [B, M]
    full_BM: jax.Array  # int32 [B, M]
    full_cached_B: jax.Array  # int32 [B]


@dataclasses.dataclass(frozen=True)
class Inspect:
    """Static option of `forward`: also return each layer's internals as `LayerRecords`. Router logits,
    chosen experts and weights, and per-head sink mass are always recorded; `hidden_states` adds the
    residual stream after each layer. The forward itself is unchanged (same kernels, same outputs); the
    records are side computations: the routing with `moe_reference.route` (what every MoE implementation
    calls) and the sink mass with the reference attention (kernels do not expose it), which costs a second
    attention pass. `inspect=None` (the default) traces exactly the serving program."""

    hidden_states: bool = False


@struct.dataclass
class LayerRecords:
    """Per-layer internals of one `forward(..., inspect=Inspect(...))`, stacked over layers in model order."""

    router_logits: jax.Array  # f32 [L, B, T, E] (router bias included)
    expert_ids: jax.Array  # i32 [L, B, T, k] the experts each token was sent to, best first
    expert_weights: jax.Array  # f32 [L, B, T, k] softmax over the k chosen logits
    sink_mass: jax.Array  # f32 [L, B, T, N] attention probability each head gives its sink
    hidden_states: jax.Array | None  # f32 [L, B, T, D] residual stream after each layer, or None


@struct.dataclass
class AttentionInputs:
    """What every attention layer of one type (sliding or full) reads in one call: where its tokens are, their RoPE
    tables, the block tables, and the (page, slot) each new token's K/V goes to (padding and already-cached tokens:
    the null page)."""

    positions_BT: jax.Array  # i32 (-1: padding)
    cos_BTF: jax.Array  # [B, T, H/2] in the model dtype, YaRN concentration included
    sin_BTF: jax.Array
    table_BM: jax.Array  # i32 pages of the layer type's pool
    write_page_BT: jax.Array  # i32
    write_slot_BT: jax.Array  # i32


@struct.dataclass
class AttentionOutputs:
    """One attention layer's result: its output projection, the pools with its K/V written, the new-token kernel's
    split counts (passed through where it does not run), and with `inspect` the sink mass."""

    y_BTD: jax.Array  # f32
    pools: Pools  # the layer type's pools, all layers
    done_BK: jax.Array | None  # i32 [B * T, K]; None inside a sharded block (the counts stay outside)
    sink_BTN: jax.Array | None  # f32 attention probability each head gives its sink, with `inspect`


def _attention_inputs(
    table_BM: jax.Array, positions_BT: jax.Array, write_from_B: jax.Array, cos_BTF, sin_BTF, page_size: int
) -> AttentionInputs:
    """The inputs of a layer type: its table, and the (page, slot) each new token writes."""
    M = table_BM.shape[1]
    col = positions_BT // page_size
    ok = (positions_BT >= write_from_B[:, None]) & (positions_BT >= 0) & (col < M)
    page = jnp.take_along_axis(table_BM, jnp.clip(col, 0, M - 1), axis=1)
    return AttentionInputs(
        positions_BT,
        cos_BTF,
        sin_BTF,
        table_BM,
        jnp.where(ok, page, NULL_PAGE),
        jnp.maximum(positions_BT, 0) % page_size,
    )


def _attention(
    cfg: ModelConfig,
    stacked: dict,
    per_layer: dict,
    layer,
    t_BTD,
    pools: Pools,
    inp: AttentionInputs,
    *,
    window: int,
    kernels: KernelConfig,
    inspect: bool,
    heads_axis: str | None,
) -> AttentionOutputs:
    """One attention layer on the normed residual stream `t_BTD`: project, write the new K/V into layer `layer`'s
    pages, attend through the table. Runs on whatever heads and rows it is given: all of them on one device, a
    device's shard under a layout (`sharding.tensor_parallel`), where `heads_axis` names the mesh axis the heads
    are split over, whose partial output projections are summed here.

    `stacked` holds every layer's projection weights (`q_w`, ...) and `layer` says which, as for the experts: the
    projection kernels read them in place instead of the scan copying each layer's ~53 MB out first; `per_layer`
    holds this layer's biases and sinks."""
    B, T, _ = t_BTD.shape
    H, dtype = cfg.head_dim, inp.cos_BTF.dtype
    page_offset = pools.page_offset(layer)
    # q, k and v in one kernel launch for decode rows: k and v alone cost a launch's latency, not their bytes
    bs = [per_layer[f"{n}_b"] for n in "qkv"]
    ws = [stacked[f"{n}_w"] for n in "qkv"]
    q, k, v = (
        y.astype(dtype).reshape(B, T, -1, H)
        for y in pallas_kernels.linear_many(t_BTD.reshape(B * T, -1), ws, bs, layer, kernels=kernels)
    )
    q, k = rope.apply(q, inp.cos_BTF, inp.sin_BTF), rope.apply(k, inp.cos_BTF, inp.sin_BTF)
    # Tokens that write nothing (padding; the full layers' prefix-cached positions) aim at the null page: their
    # writes are dropped rather than made. Made, hundreds of them a row on one page serialized the scatter: a prefill
    # after an 881-token cached prefix took twice the time of the whole prompt's (BENCHMARKS §23).
    drop = inp.write_page_BT == NULL_PAGE
    if kernels.impl == "reference" and pools.k_scale is None:
        # into the pools' [L, P, ...] shape: written flat (after a reshape), XLA's CPU copied the whole pool for each
        # one-token write (~110 of the demo checkpoint's ~130 ms a decode step at LLVM level 0, the tests' setting)
        at = (pools.row(layer), jnp.where(drop, jnp.iinfo(jnp.int32).max, inp.write_page_BT), inp.write_slot_BT)
        flat = pools.replace(k=_put(pools.k, at, k), v=_put(pools.v, at, v)).flat()
    else:
        page = jnp.where(drop, jnp.iinfo(jnp.int32).max, page_offset + inp.write_page_BT)
        flat = _write(pools.flat(), (page, inp.write_slot_BT), k, v)
    if kernels.impl == "reference":
        # The pure-JAX attention reads the written pools. Without the barrier XLA (CPU) fused that read through the
        # write (old pages plus the new token) and copied each donated pool 3 times a batch-1 decode call, once with
        # it: ~70 ms of the demo model's ~80 ms decode step (64 MB cache). The kernels' path is as measured on the GPU.
        flat = jax.lax.optimization_barrier(flat)
    table = inp.table_BM + page_offset
    args = (q, flat.k, flat.v, table, inp.positions_BT, per_layer["sinks"], window)
    o = pallas_kernels.attention(*args, **flat.scales(), kernels=kernels)
    sink = None
    if inspect:  # a side computation for the record: the output stays the serving implementation's
        _, sink = attention_reference.attention(*args, **flat.scales(), return_sink_mass=True)
    o_b = per_layer["o_b"]
    o_w = stacked["o_w"]
    o = o.reshape(B * T, -1)
    if heads_axis is None:
        y = pallas_kernels.linear(o, o_w, o_b, layer, kernels=kernels)
    else:  # this device's heads: a partial sum of the projection, the bias added once
        y = jax.lax.psum(pallas_kernels.linear(o, o_w, jnp.zeros_like(o_b), layer, kernels=kernels), heads_axis)
        y = y + o_b.astype(jnp.float32)
    return AttentionOutputs(y.reshape(B, T, -1), pools.like(flat), None, sink)


def _put(pool_LPSKH, at: tuple, x_BTKH):
    """`x` into (layer, page, slot) `at` of a `[L, P, S, K, H]` pool; pages past its end are not written."""
    return pool_LPSKH.at[at].set(x_BTKH, mode="drop")


def _write(pools: Pools, at: tuple, k_BTKH, v_BTKH) -> Pools:
    """New K and V into (page, slot) `at` of flat pools (pages past the pools' end: not written); an FP8 pool stores
    them with `kv_quant.quantize` (its values `[P, K, H, S]`)."""
    if pools.k_scale is None:
        return pools.replace(k=pools.k.at[at].set(k_BTKH, mode="drop"), v=pools.v.at[at].set(v_BTKH, mode="drop"))
    (k, k_scale), (v, v_scale) = kv_quant.quantize(k_BTKH), kv_quant.quantize(v_BTKH)
    return Pools(
        pools.k.at[at].set(k, mode="drop"),
        kv_quant.set_values(pools.v, at, v),
        kv_quant.set_scales(pools.k_scale, at, k_scale),
        kv_quant.set_scales(pools.v_scale, at, v_scale),
    )


def _attention_new_token(
    cfg: ModelConfig,
    stacked: dict,
    per_layer: dict,
    layer,
    t_BTD,
    pools: Pools,
    done_BK,
    inp: AttentionInputs,
    *,
    window: int,
    kernels: KernelConfig,
) -> AttentionOutputs:
    """`_attention` for decode on one device with the kernels (`pallas_kernels.fuses_new_token`: one token a row, or a
    verify step's few): the projections' epilogue, RoPE, the cache write and the merge of the sequence splits
    (counted in `done_BK`, a row per token) ride in one kernel, which reads every layer's q/k/v biases and sinks in
    place (`stacked`) instead of slicing them per layer."""
    B, T, _ = t_BTD.shape
    flat = pools.flat()  # the kernel takes the layer's page offset from `layer`'s counter
    tokens = lambda a: a.reshape(B * T, *a.shape[2:])  # noqa: E731
    o, k_pool, v_pool, done_BK, k_scale, v_scale = pallas_kernels.attention_new_token(
        tokens(t_BTD),
        [stacked[f"{n}_w"] for n in "qkv"],
        [stacked[f"{n}_b"] for n in "qkv"],
        layer,
        tokens(inp.cos_BTF),
        tokens(inp.sin_BTF),
        flat.k,
        flat.v,
        inp.table_BM,
        None,
        tokens(inp.positions_BT),
        tokens(inp.write_page_BT),
        tokens(inp.write_slot_BT),
        stacked["sinks"],
        window,
        done_BK,
        **flat.scales(),
        null_page=NULL_PAGE,
        kernels=kernels,
    )
    y = pallas_kernels.linear(o.reshape(B * T, -1), stacked["o_w"], per_layer["o_b"], layer, kernels=kernels)
    flat = Pools(k_pool, v_pool, k_scale, v_scale)
    return AttentionOutputs(y.reshape(B, T, -1), pools.like(flat), done_BK, None)


def _attention_block(
    cfg: ModelConfig,
    lp,
    dense_all,
    layer,
    t_BTD,
    pools: Pools,
    done_BK,
    inp: AttentionInputs,
    *,
    window: int,
    kernels: KernelConfig,
    inspect: bool,
    layout,
) -> AttentionOutputs:
    """One attention layer: the new-token kernel for decode on one device, else `_attention` on one device or per
    device under a `layout` (its rows, pages and heads)."""
    stacked = {n: getattr(dense_all, n) for n in tensor_parallel.STACKED}
    per_layer = {n: getattr(lp, n) for n in tensor_parallel.PER_LAYER}
    B, T, _ = t_BTD.shape
    q_shape = (B, T, cfg.num_heads, cfg.head_dim)
    if (
        layout is None
        and not inspect
        and pallas_kernels.fuses_new_token(q_shape, cfg.num_kv_heads, pools.k.dtype, kernels)
    ):
        stacked.update({n: getattr(dense_all, n) for n in ("q_b", "k_b", "v_b", "sinks")})
        return _attention_new_token(
            cfg, stacked, per_layer, layer, t_BTD, pools, done_BK, inp, window=window, kernels=kernels
        )
    heads_axis = tensor_parallel.heads_axis(layout, cfg.num_kv_heads) if layout is not None else None
    block = functools.partial(_attention, cfg, window=window, kernels=kernels, inspect=inspect, heads_axis=heads_axis)
    if layout is not None:
        layer = layer_index.value(layer)
        pool_kinds = Pools("pool", "pool") if pools.k_scale is None else Pools("pool", "values", "scales", "scales")
        in_kinds = ("same", "rows", pool_kinds, jax.tree.map(lambda _: "rows", inp))
        out_kinds = AttentionOutputs("rows", pool_kinds, None, "heads" if inspect else None)
        block = tensor_parallel.attention(layout, block, cfg.num_kv_heads, in_kinds, out_kinds)
    return block(stacked, per_layer, layer, t_BTD, pools, inp).replace(done_BK=done_BK)


def _moe_block(
    cfg: ModelConfig, lp, dense_all, final_norm, layer, x_BTD, *, dtype, kernels: KernelConfig, inspect: bool, layout
):
    """The MoE layer with its residual add, and the next block's norm: (x `[B, T, D]` f32, its `rms_norm` with
    the gain of the attention after it or the final one), and with `inspect` its routing (logits, ids, weights)
    `[B, T, ...]` (else None).

    `dense_all` holds every layer's norms, router and experts and `layer` says which: the kernels read the
    routed experts straight out of the stacked arrays, where slicing one layer out first would copy all of
    its experts (~0.8 GB per 20b layer) every step."""
    B, T, D = x_BTD.shape
    x = x_BTD.reshape(B * T, D)
    kw = dict(top_k=cfg.experts_per_token, swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha)
    gains, eps = (dense_all.attn_norm, final_norm), cfg.rms_norm_eps
    routing = None
    if inspect or layout is not None:
        t = rms_norm(x, lp.mlp_norm, eps, dtype)
    if inspect:  # a side computation: `moe_reference.route` is the routing every implementation computes
        idx, w, logits = moe_reference.route(t, lp.router_w, lp.router_b, cfg.experts_per_token)
        routing = tuple(r.reshape(B, T, -1) for r in (logits, idx, w))
    if layout is not None:  # experts split over `model` (padded), tokens as the ranks hold them
        layer = layer_index.value(layer)
        x = x + expert_parallel.moe(
            t, lp.router_w, lp.router_b, dense_all.experts, layer, layout=layout, kernels=kernels, **kw
        ).astype(jnp.float32)
        t = rms_norm(x, pallas_kernels.next_gain(*gains, layer), eps, dtype)
    else:
        x, t = pallas_kernels.moe_block(
            x,
            dense_all.mlp_norm,
            dense_all.router_w,
            dense_all.router_b,
            dense_all.experts,
            layer,
            gains,
            eps=eps,
            dtype=dtype,
            kernels=kernels,
            **kw,
        )
    return x.reshape(B, T, D), t.reshape(B, T, D), routing


def _exact_in_fp32(fn):
    """fp32 is the exactness mode: without HIGHEST precision, GPUs (XLA and the Pallas-Triton kernels
    alike) run fp32 matmuls as TF32, ~1e-3 relative error. Resolved at trace time, so it reaches every
    dot of the program, kernels included."""

    @functools.wraps(fn)
    def wrapped(params, *args, **kwargs):
        if params.embed.dtype != jnp.float32:
            return fn(params, *args, **kwargs)
        with jax.default_matmul_precision("highest"):
            return fn(params, *args, **kwargs)

    return wrapped


@_exact_in_fp32
def forward(
    params: Params,
    cache: PagedKVCache,
    tokens_BT: jax.Array,
    positions_BT: jax.Array,
    tables: PageTables,
    cfg: ModelConfig,
    kernels: KernelConfig = REFERENCE,
    inspect: Inspect | None = None,
    layout=None,
    aux_layers: tuple[int, ...] = (),
) -> (
    tuple[jax.Array, PagedKVCache, LayerRecords | None] | tuple[jax.Array, PagedKVCache, LayerRecords | None, jax.Array]
):
    """Run the layers on new tokens at `positions_BT` (-1 = padding), writing their K/V into `cache`.

    Returns the final-normed hidden states `[B, T, D]` (pass the rows you need to `unembed`), the updated cache,
    and with `inspect=Inspect(...)` (static) the `LayerRecords` of every layer (else None). Weights, the cache and
    matmul operands are in the parameters' dtype; the residual stream and every accumulation are fp32 (a bf16
    residual drifts enough to flip router choices). `kernels` (static) says which kernels run
    (`pallas_kernels.choice`). `layout` (static `sharding.rules.Layout`; None on one device): rows are rank-major,
    page tables hold rank-local page ids, experts are padded to the `model` axis (docs/SCALING.md).
    `aux_layers` (static; EAGLE-3's auxiliary hidden states, `gptoss_jax.eagle3`): with ids `i` in `0..num_layers`
    a fourth output `[len(aux_layers), B, T, D]` f32 holds the residual stream entering layer `i` (0: the
    embeddings; `num_layers`: the last layer's output, before the final norm), as vLLM numbers them. Each layer
    writes into one carried buffer in place, so a call costs one `[B, T, D]` write per layer; `()` traces the
    plain program.
    """
    pin = layout.constrain_rows if layout is not None else (lambda a: a)
    on = inspect is not None
    dtype = params.embed.dtype
    S = cache.page_size
    x = pin(params.embed[tokens_BT].astype(jnp.float32))  # the residual stream stays fp32
    cos, sin = rope.cos_sin(cfg, jnp.maximum(positions_BT, 0), dtype)
    inputs = {  # per layer type: sliding layers never write into shared (prefix-cached) pages
        True: _attention_inputs(tables.sliding_BM, positions_BT, jnp.zeros_like(tables.full_cached_B), cos, sin, S),
        False: _attention_inputs(tables.full_BM, positions_BT, tables.full_cached_B, cos, sin, S),
    }
    windows = {True: cfg.sliding_window, False: FULL_WINDOW}

    # A step with no token (all positions padding) is not live: its kernels skip their weight reads (`layer_index`)
    live = jnp.any(positions_BT >= 0).astype(jnp.int32).reshape(1)

    def layer(x, t, caches, lp, i, p: int, per: int, sliding: bool):  # t: x normed for this layer's attention
        """Layer `2 (per i + p)` (+ 1 if not `sliding`): pair p of the scan's step i, of `per` pairs a step."""
        pools, done, aux = caches
        # its index in model order and its first page, which the kernels compute from the counter (`layer_index`)
        P = pools[sliding].k.shape[1]
        n = layer_index.LayerIndex(jnp.asarray(i, jnp.int32), 2 * per, 2 * p + (not sliding), per * P, p * P, live)
        if aux_layers:  # the stream entering layer n into its aux slot; other layers write the spare last slot
            hit = ids == n.value()
            slot = jnp.where(jnp.any(hit), jnp.argmax(hit), len(aux_layers))
            aux = jax.lax.dynamic_update_index_in_dim(aux, x, slot, 0)
        with jax.named_scope("sliding_attention" if sliding else "full_attention"):
            out = _attention_block(
                cfg,
                lp,
                dense_all,
                n,
                t,
                pools[sliding],
                done,
                inputs[sliding],
                window=windows[sliding],
                kernels=kernels,
                inspect=on,
                layout=layout,
            )
            pools = {**pools, sliding: out.pools}
            x = pin(x + out.y_BTD)
        with jax.named_scope("moe"):
            x, t, routing = _moe_block(
                cfg, lp, dense_all, params.final_norm, n, x, dtype=dtype, kernels=kernels, inspect=on, layout=layout
            )
            x, t = pin(x), pin(t)
        record = (*routing, out.sink_BTN, x if inspect.hidden_states else None) if on else None
        return x, t, (pools, out.done_BK, aux), record

    def step(carry, lp_step, per: int):  # `per` layer pairs
        x, t, caches, i = carry
        records = []
        for j in range(2 * per):
            lp = jax.tree.map(lambda a: a[j], lp_step)
            x, t, caches, r = layer(x, t, caches, lp, i, j // 2, per, sliding=j % 2 == 0)
            records.append(r)
        return (x, t, caches, i + 1), (tuple(records) if on else None)

    pairs, (B, T) = cfg.num_layers // 2, tokens_BT.shape
    # Calls of a few tokens (`kernels.scan_pairs_tokens`: batch-1 decode and verify steps) scan two layer pairs a step
    # where the pairs are even. The counter rides in the carry: sliced from an arange, it cost a copy kernel a step.
    per = 2 if pairs % 2 == 0 and B * T <= kernels.scan_pairs_tokens else 1
    # The pools by layer type, and the new-token attention kernel's split counts (a row per token where it may run):
    # one zeroed buffer for all layers.
    # With `aux_layers`, their buffer (a spare last slot takes the other layers' writes) rides along.
    if aux_layers and not all(0 <= i <= cfg.num_layers for i in aux_layers):
        raise ValueError(f"aux_layers {aux_layers} must lie in 0..{cfg.num_layers} (the residual entering layer i)")
    ids = jnp.asarray(aux_layers, jnp.int32) if aux_layers else None
    caches = (
        {True: cache.pools(True), False: cache.pools(False)},
        jnp.zeros((B * T if T <= kernels.attention_rows_tokens else B, cfg.num_kv_heads), jnp.int32),
        jnp.zeros((len(aux_layers) + 1, *x.shape), jnp.float32) if aux_layers else None,
    )
    # The big per-layer weights are indexed inside the blocks (no copy), the rest is sliced by the scan.
    dense_all = params.layers
    # Each MoE block ends with the next block's norm (the kernels fuse it), so the first norm is taken here.
    t = pin(rms_norm(x, dense_all.attn_norm[0], cfg.rms_norm_eps, dtype))
    scanned = params.layers.replace(experts=None, q_w=None, k_w=None, v_w=None, o_w=None)
    records = []  # with `inspect`: per-layer records, stacked on a leading layer axis
    with jax.named_scope("layers"):
        if pairs:
            steps = pairs // per
            stacked = jax.tree.map(lambda a: a[: 2 * pairs].reshape(steps, 2 * per, *a.shape[1:]), scanned)
            body = functools.partial(step, per=per)
            (x, t, caches, _), ys = jax.lax.scan(body, (x, t, caches, jnp.int32(0)), stacked)
            if on:  # [steps] of the step's layers -> [2 * pairs] in layer order
                records.append(jax.tree.map(lambda *a: jnp.stack(a, 1).reshape(2 * pairs, *a[0].shape[1:]), *ys))
        if cfg.num_layers % 2:  # an odd layer count ends on a sliding layer
            x, t, caches, r = layer(x, t, caches, jax.tree.map(lambda a: a[-1], scanned), pairs, 0, 1, sliding=True)
            if on:
                records.append(jax.tree.map(lambda a: a[None], r))
    cache = PagedKVCache.of(caches[0][True], caches[0][False])
    if layout is not None:  # the pools keep their placement from call to call (donated in place)
        cache = jax.lax.with_sharding_constraint(cache, layout.cache_shardings(cache, cfg.num_kv_heads))
    # t: the last block's output, normed with the final gain
    out = (t, cache, (LayerRecords(*jax.tree.map(lambda *a: jnp.concatenate(a), *records)) if on else None))
    if not aux_layers:
        return out
    aux = caches[2][: len(aux_layers)]
    if cfg.num_layers in aux_layers:  # after the last layer: the stream the final norm reads
        aux = aux.at[aux_layers.index(cfg.num_layers)].set(x)
    return (*out, aux)


@_exact_in_fp32
def unembed(params: Params, x_BD: jax.Array) -> jax.Array:
    """Logits in fp32 for hidden states `[..., D]` (untied output matrix, no bias, no soft-cap)."""
    with jax.named_scope("unembed"):
        return jnp.einsum("...d,vd->...v", x_BD, params.unembed, preferred_element_type=jnp.float32)
