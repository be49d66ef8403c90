"""The hot operations of gpt-oss, each with a pure-JAX reference beside its Pallas kernels.

`attention`, `attention_new_token` (decode: q/k/v projections, RoPE, cache write and attention), `moe_block` (norm,
`moe`, residual add and the next block's norm), `linear`, `linear_many` (several weights of one input) and (for expert
parallelism, where routing and dispatch happen outside) `experts` are the only entry points the model calls; `impl`
picks the implementation: `"pallas"` (the kernels; the default on GPUs) or `"reference"` (pure JAX; the
default elsewhere, since the Pallas-Triton kernels only lower for GPUs and would run interpreted). The
kernels read the experts in their own relayout of the same bytes, made tensor by tensor as the checkpoint
loads (`relayout_expert_field`), or by `prepare_params` for parameters already on device.
"""

import functools

import jax
import jax.experimental.pallas.fuser  # noqa: F401  (see below)
import jax.numpy as jnp

from pallas_kernels.norm import rms_norm
from pallas_kernels.params import put_layer
from pallas_kernels import (attention_reference, flash_attention, linear_decode, linear_mosaic, moe_decode,
                            moe_mosaic, moe_prefill, moe_reference, moe_route, paged_attention)

# `jax.experimental.pallas.fuser` is imported above for its side effect only: the first `pallas_call` would
# import it lazily and register a config option that is part of every jit's cache key, so every step
# traced before it (the first engine step, a benchmark's warm-up) would be traced and compiled again.

IMPLS = ("reference", "pallas")


def default_impl() -> str:
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def check_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"unknown kernel implementation '{impl}'; choose one of {IMPLS}")
    return impl


def expert_shapes(experts, impl: str):
    """The experts' shapes (`jax.ShapeDtypeStruct` tree) in the layout `impl` reads."""
    return experts if check_impl(impl) == "reference" else jax.eval_shape(moe_decode.prepare_experts, experts)


def expert_field(name: str, impl: str) -> str:
    """The field of `impl`'s expert layout made from the `params.Experts` field `name`."""
    return name if check_impl(impl) == "reference" else moe_decode.KERNEL_FIELDS[name]


def relayout_expert_field(name: str, x: jax.Array, impl: str) -> jax.Array:
    """One `params.Experts` field (of one layer) as `impl` reads it. The loader calls this tensor by
    tensor, so a checkpoint is never on the device in both layouts at once."""
    return x if check_impl(impl) == "reference" else _relayout_jit(name, x)


@functools.partial(jax.jit, static_argnums=0)
def _relayout_jit(name, x):
    return moe_decode.relayout_field(name, x)


def prepare_params(params, impl: str):
    """Parameters already on device, in the layout `impl` reads (the loader and `random_params` produce it
    directly). Converts one field of one layer at a time into a preallocated buffer, so the peak is the
    experts plus their converted copy, never a whole layer's temporaries on top. Experts split over a
    mesh (`sharding.rules.Layout`) stay split: each device converts its own experts."""
    experts = params.layers.experts
    if check_impl(impl) == "reference":
        return params
    if not isinstance(experts, moe_decode.KernelExperts):
        shapes, out = expert_shapes(experts, impl), {}
        for name, kname in moe_decode.KERNEL_FIELDS.items():
            src, want = getattr(experts, name), getattr(shapes, kname)
            buf = jnp.zeros(want.shape, want.dtype, device=_expert_placement(src.sharding))
            for layer in range(src.shape[0]):
                buf = put_layer(buf, relayout_expert_field(name, src[layer], impl), layer)
            out[kname] = buf
        experts = moe_decode.KernelExperts(**out)
    if (experts.gu_sexp is None and params.embed.dtype != jnp.float32 and moe_mosaic.available()
            and moe_mosaic.fits(experts)):
        experts = _with_scale_operands(experts)
    if experts is params.layers.experts:
        return params
    return params.replace(layers=params.layers.replace(experts=experts))


def _with_scale_operands(kexp: moe_decode.KernelExperts) -> moe_decode.KernelExperts:
    """`kexp` with the Mosaic kernels' scale operands stored, one layer at a time: derived per call they
    cost ~1 ms per token at batch 256 (20b, H200); stored they add ~7% to the scales' bytes."""
    make = jax.jit(moe_mosaic.scale_operands)
    shapes = jax.eval_shape(make, kexp.gu_scales[0], kexp.dn_scales[0])
    L, where = kexp.gu_scales.shape[0], _expert_placement(kexp.gu_scales.sharding)
    bufs = [jnp.zeros((L, *s.shape), s.dtype, device=where) for s in shapes]
    for layer in range(L):
        for i, x in enumerate(make(kexp.gu_scales[layer], kexp.dn_scales[layer])):
            bufs[i] = put_layer(bufs[i], x, layer)
    return kexp.replace(**dict(zip(("gu_sexp", "gu_rowfac", "dn_sexp", "dn_rowfac"), bufs)))


def _expert_placement(sharding):
    """The placement of a converted field: the source's split of the (layer, expert) axes, if any; on one
    device none, so the field stays uncommitted like every array the loader returns."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[:2]))
    return None


def attention(q_BTNH, k_pages_PSKH, v_pages_PSKH, block_tables_BM, q_pos_BT, sinks_N, window: int, *,
              impl: str = "reference"):
    """Paged attention with sinks; the contract is in docs/engine.md ("Kernel interface")."""
    args = (q_BTNH, k_pages_PSKH, v_pages_PSKH, block_tables_BM, q_pos_BT, sinks_N, window)
    if check_impl(impl) == "reference":
        return attention_reference.attention(*args)
    kernel = paged_attention if q_BTNH.shape[1] == 1 else flash_attention  # decode / prefill chunk
    return kernel.attention(*args)


def fuses_new_token(B: int, T: int, impl: str) -> bool:
    """Whether decode (T = 1) takes `attention_new_token`: with the kernels, up to `paged_attention.NEW_TOKEN_ROWS`."""
    return check_impl(impl) == "pallas" and T == 1 and B <= paged_attention.NEW_TOKEN_ROWS


def attention_new_token(t_BI, ws_LOI, bs_LO, layer, cos_BF, sin_BF, k_pages_PSKH, v_pages_PSKH, block_tables_BM,
                        page_offset, q_pos_B, write_page_B, write_slot_B, sinks_LN, window: int, done_BK, *,
                        null_page: int):
    """Decode with the kernels, one token per row: the q, k and v projections of the normed `t_BI` (weights
    and biases stacked over layers, `linear_partials`), then `paged_attention.attention_new_token` (their
    sums, biases and RoPE, the cache write, the attention and the merge of its splits in one launch, counted
    in `done_BK`) -> (`[B, 1, N, H]`, k pages, v pages, done_BK)."""
    parts = linear_partials(t_BI, ws_LOI, layer, impl="pallas")
    return paged_attention.attention_new_token(parts, tuple(bs_LO), layer, cos_BF, sin_BF, k_pages_PSKH, v_pages_PSKH,
                                               block_tables_BM, page_offset, q_pos_B, write_page_B, write_slot_B,
                                               sinks_LN, window, done_BK, null_page=null_page)


def linear(x_TI, w_LOI, b_O, layer, *, impl: str = "reference"):
    """`x @ w[layer].T + b` in fp32, for a weight stacked over layers: `linear_many` of one weight."""
    return linear_many(x_TI, (w_LOI,), (b_O,), layer, impl=impl)[0]


def linear_many(x_TI, ws_LOI, bs_O, layer, *, impl: str = "reference"):
    """`linear` of the same x by several weights (q, k, v) -> a tuple: `linear_partials` summed with the biases."""
    parts = linear_partials(x_TI, ws_LOI, layer, impl=impl)
    return tuple(jnp.sum(y, axis=0) + b.astype(jnp.float32) for y, b in zip(parts, bs_O))


def linear_partials(x_TI, ws_LOI, layer, *, impl: str = "reference"):
    """`x @ w[layer].T` for each weight, as fp32 partial sums `[splits, T, O]` whose sum (plus the bias) the
    consumer fuses. On Hopper from `linear_mosaic.MIN_ROWS` to 256 rows the Mosaic kernel runs all weights in
    one launch (one split: it accumulates in place). Elsewhere the Triton kernel: up to `FUSE_ROWS` rows in one
    launch (small weights cost launch latency, not bytes), up to `MAX_ROWS` one launch each; beyond, XLA's GEMM
    amortises its copy of the layer slice."""
    T, I = x_TI.shape
    if (check_impl(impl) == "pallas" and linear_mosaic.available() and T >= linear_mosaic.MIN_ROWS
            and linear_mosaic.fits(T, I, ws_LOI[0].dtype)):
        cfg = linear_mosaic.config(T, I, [w.shape[1] for w in ws_LOI])
        zeros = tuple(jnp.zeros(w.shape[1], jnp.float32) for w in ws_LOI)
        return tuple(y[None] for y in linear_mosaic.linear_many(x_TI, tuple(ws_LOI), zeros, layer, **cfg))
    if impl == "pallas" and T <= linear_decode.MAX_ROWS:
        if T <= linear_decode.FUSE_ROWS:
            return linear_decode.partial_sums(x_TI, tuple(ws_LOI), layer)
        return tuple(linear_decode.partial_sums(x_TI, (w,), layer)[0] for w in ws_LOI)
    return tuple(linear_decode.reference(x_TI, w, jnp.zeros(w.shape[1], jnp.float32), layer)[None] for w in ws_LOI)


def experts(x_TD, idx_TK, w_TK, experts_all, layer, valid_TK=None, *, swiglu_limit, swiglu_alpha,
            impl: str = "reference"):
    """`sum_k w[t, k] * expert_{idx[t, k]}(x[t])` in fp32 for given routing, with the stacked experts and
    `layer` as in `moe`, and the kernel configuration `moe` would pick for that many tokens. Pairs outside
    `valid_TK` (bool) must carry weight 0; the kernels skip them (the reference computes them)."""
    kw = dict(swiglu_limit=float(swiglu_limit), swiglu_alpha=float(swiglu_alpha))
    if check_impl(impl) == "reference":
        one = jax.tree.map(lambda a: a[layer], experts_all)
        return moe_reference.apply_experts(x_TD, idx_TK, w_TK, one, **kw)
    return moe_prefill.experts(x_TD, idx_TK, w_TK, experts_all, layer, valid_TK, **kw).astype(jnp.float32)


def moe(x_TD, router_w_ED, router_b_E, experts, *, top_k, swiglu_limit, swiglu_alpha, layer=None,
        impl: str = "reference"):
    """Top-k MXFP4 experts; `experts` is `params.Experts` (reference) or `KernelExperts` (pallas), of one
    layer, or of all layers stacked with `layer` (traced) choosing one: the kernels then index the
    stacked arrays directly, so no per-layer copy of the experts is made."""
    kw = dict(top_k=top_k, swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha)
    if check_impl(impl) == "pallas":
        return moe_prefill.moe(x_TD, router_w_ED, router_b_E, experts, layer=layer, **kw)
    if layer is not None:
        experts = jax.tree.map(lambda a: a[layer], experts)
    return moe_reference.moe(x_TD, router_w_ED, router_b_E, experts, **kw)


def moe_block(x_TD, norm_LD, router_w_LED, router_b_LE, experts_all, layer, next_gains, *, eps, dtype, top_k,
              swiglu_limit, swiglu_alpha, impl: str = "reference"):
    """The MoE layer on the fp32 residual stream `x_TD` with its residual add, and the next block's norm: `rms_norm`
    with layer `layer`'s gain, `moe`, the sum with `x_TD`, and its `rms_norm` with the next gain (`next_gains` =
    (attention gains `[L, D]`, final gain `[D]`): row `layer + 1` of the first, or the second after the last
    layer); all weights stacked over layers. Returns (x `[T, D]` f32, its norm in `dtype`). For a few decode
    tokens of a bf16 model the kernels run `moe_route.moe`: its front end (norm, routing and the GEMV operand in
    one launch), the experts, and its back end (expert sum, residual add and the next norm in one launch)."""
    kw = dict(top_k=top_k, swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha)
    if check_impl(impl) == "pallas" and moe_route.applies(x_TD.shape[0], top_k, router_w_LED.shape[1], dtype):
        return moe_route.moe(x_TD, norm_LD, router_w_LED, router_b_LE, experts_all, layer, next_gains, eps=eps,
                             dtype=dtype, **kw)
    t = rms_norm(x_TD, norm_LD[layer], eps, dtype)
    x = x_TD + moe(t, router_w_LED[layer], router_b_LE[layer], experts_all, layer=layer, impl=impl, **kw).astype(
        jnp.float32)
    return x, rms_norm(x, next_gain(*next_gains, layer), eps, dtype)


def next_gain(gain_LD, final_D, layer):
    """The norm gain of the block after layer `layer`'s MoE: layer `layer + 1`'s attention gain, or the final one."""
    L = gain_LD.shape[0]
    return jnp.where(layer + 1 < L, gain_LD[jnp.minimum(layer + 1, L - 1)], final_D)
