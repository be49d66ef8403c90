"""The hot operations of gpt-oss, each with a pure-JAX reference beside its Pallas kernels.

`attention`, `attention_new_token` (decode: q/k/v projections, RoPE, cache write and attention), `moe_block` (norm,
`moe`, residual add and the next block's norm), `linear`, `linear_many`, `linear_partials` (several weights of one
input) and (for expert parallelism, where routing and dispatch happen outside) `experts` are the entry points the
model calls. Each takes the engine's `KernelConfig` (`kernels`) and asks `choice.choose` which kernel runs, with
which launch settings; `impl="reference"` runs pure JAX everywhere. The kernels read the experts in their own
relayout of the same bytes (`expert_format`), made tensor by tensor as the checkpoint loads
(`relayout_expert_field`), or by `prepare_params` for parameters already on device.
"""

import dataclasses
import functools
import logging

import jax
import jax.experimental.pallas.fuser  # noqa: F401  (see below)
import jax.numpy as jnp

from pallas_kernels import (
    attention_reference,
    choice,
    expert_format,
    flash_attention,
    layer_index,
    linear_decode,
    linear_mosaic,
    moe_dense,
    moe_gemv,
    moe_mma,
    moe_mosaic,
    moe_reference,
    moe_route,
    paged_attention,
)
from pallas_kernels.choice import IMPLS, REFERENCE, Choice, Device, KernelConfig, choose
from pallas_kernels.expert_format import KernelExperts
from pallas_kernels.norm import rms_norm
from pallas_kernels.params import put_layer

__all__ = [
    "IMPLS",
    "REFERENCE",
    "Choice",
    "Device",
    "KernelConfig",
    "KernelExperts",
    "choose",
    "attention",
    "attention_new_token",
    "fuses_new_token",
    "linear",
    "linear_many",
    "linear_partials",
    "experts",
    "moe",
    "moe_block",
    "next_gain",
    "prepare_params",
    "cpu_unembedding",
    "expert_shapes",
    "expert_field",
    "relayout_expert_field",
    "with_scale_operands",
    "bf16_experts",
    "with_bf16_experts",
]

log = logging.getLogger(__name__)

# `jax.experimental.pallas.fuser` is imported above for its side effect only: the first `pallas_call` would
# import it lazily and register a config option that is part of every jit's cache key, so every step
# traced before it (the first engine step, a benchmark's warm-up) would be traced and compiled again.


def _resolved(kernels: KernelConfig) -> KernelConfig:
    return kernels if kernels.device is not None else kernels.for_device()


def _choose(op: str, rows: int, shape: tuple, dtype, kernels: KernelConfig) -> Choice:
    """`choose`, with the kernels interpreted exactly when the device the config is for is no GPU: that device, not
    the tracing process's backend, decides, so that a process without a GPU lowers the GPU's programs (the
    engine's lowering workers, `gptoss_jax/lowering.py`)."""
    kernels = _resolved(kernels)
    c = choose(op, rows, shape, dtype, kernels.device, kernels)
    if c.kernel == "reference":
        return c
    return dataclasses.replace(c, launch={**c.launch, "interpret": kernels.device.platform != "gpu"})


# ---- the experts' layout ---------------------------------------------------------------------------------------


def expert_shapes(experts, impl: str):
    """The experts' shapes (`jax.ShapeDtypeStruct` tree) in the layout `impl` ("reference" or "pallas") reads."""
    return experts if impl == "reference" else jax.eval_shape(expert_format.prepare_experts, experts)


def expert_field(name: str, impl: str) -> str:
    """The field of `impl`'s expert layout made from the `params.Experts` field `name`."""
    return name if impl == "reference" else expert_format.KERNEL_FIELDS[name]


def relayout_expert_field(name: str, x: jax.Array, impl: str) -> jax.Array:
    """One `params.Experts` field (of one layer) as `impl` reads it. The loader calls this tensor by
    tensor, so a checkpoint is never on the device in both layouts at once."""
    return x if impl == "reference" else _relayout_jit(name, x)


@functools.partial(jax.jit, static_argnums=0)
def _relayout_jit(name, x):
    return expert_format.relayout_field(name, x)


def prepare_params(params, kernels: KernelConfig):
    """Parameters already on device, in the layout the kernels of `kernels` read (the loader and `random_params`
    produce it directly), with the Mosaic kernels' scale operands where those kernels run, and with
    `kernels.moe_prefill_bf16_experts` the experts' bf16 copy for the grouped prefill GEMMs (`with_bf16_experts`;
    dropped when the option is off, so the config alone decides whether a call dequantizes). Converts one field of
    one layer at a time into a preallocated buffer, so the peak is the experts plus their converted copy, never a
    whole layer's temporaries on top. Experts split over a mesh (`sharding.rules.Layout`) stay split: each device
    converts its own experts. On a CPU the output matrix goes to f32 (`cpu_unembedding`)."""
    kernels = _resolved(kernels)
    params = cpu_unembedding(params, kernels.device)
    experts = params.layers.experts
    if kernels.impl == "reference":
        return bf16_experts(params, kernels)  # none: the reason logged if asked for
    if not isinstance(experts, KernelExperts):
        shapes, out = expert_shapes(experts, "pallas"), {}
        for name, kname in expert_format.KERNEL_FIELDS.items():
            src, want = getattr(experts, name), getattr(shapes, kname)
            buf = jnp.zeros(want.shape, want.dtype, device=_expert_placement(src.sharding))
            for layer in range(src.shape[0]):
                buf = put_layer(buf, relayout_expert_field(name, src[layer], "pallas"), layer)
            out[kname] = buf
        experts = KernelExperts(**out)
    if (
        experts.gu_sexp is None
        and params.embed.dtype != jnp.float32
        and kernels.mosaic
        and moe_mosaic.fits(experts.dn_words.shape[-2], experts.gu_words.shape[-2])
    ):
        experts = with_scale_operands(experts)
    if experts is not params.layers.experts:
        params = params.replace(layers=params.layers.replace(experts=experts))
    return bf16_experts(params, kernels)


def cpu_unembedding(params, device: Device):
    """On a CPU, the output matrix in f32 where the model is in bf16 or f16: XLA's CPU dot converts a half-precision
    operand to f32 in every call, and for the 201,088-row matrix that conversion was most of a decode step of the demo
    checkpoint (44 against 5 ms a call). The copy holds the same values; the logits are the f32 products' (the bf16
    matrix's bit for bit at one row; at several, XLA's bf16 dot sums in another order, ~1e-6 relative)."""
    if device.platform != "cpu" or params.unembed.dtype not in (jnp.bfloat16, jnp.float16):
        return params
    return params.replace(unembed=params.unembed.astype(jnp.float32))


def bf16_experts(params, kernels: KernelConfig):
    """`params` (experts in the kernels' layout) with the bf16 copy of the experts that `kernels` asks for
    (`moe_prefill_bf16_experts`): made once (`with_bf16_experts`) where the grouped prefill GEMMs read it, else none.
    Where the model never takes those GEMMs (`choice.bf16_experts_unused`) or the copy would take more than half of
    the devices' free memory (`_bf16_too_big`: 20b on an 80 GB GPU, 120b on one GPU) the option is ignored, logged
    with the reason: a speed option with the same outputs either way, which both profiles turn on for
    every model, so it must not leave the KV cache a fraction of what it had."""
    kernels = _resolved(kernels)
    experts = params.layers.experts
    want = kernels.moe_prefill_bf16_experts
    why = _bf16_unused(experts, params, kernels) if want else ""
    if want and not why and experts.gu_bf16 is None:
        why = _bf16_too_big(experts)
    if why:
        log.info("kernels.moe_prefill_bf16_experts ignored: %s", why)
    if not want or why:
        if getattr(experts, "gu_bf16", None) is None:
            return params
        experts = experts.replace(gu_bf16=None, dn_bf16=None)
    elif experts.gu_bf16 is None:
        platform = next(iter(experts.gu_words.devices())).platform
        experts = with_bf16_experts(experts, interpret=platform != "gpu")
        log.info(
            "kernels.moe_prefill_bf16_experts: stored the experts in bf16 for the grouped prefill GEMMs, %.1f GB",
            (experts.gu_bf16.nbytes + experts.dn_bf16.nbytes) / 1e9,
        )
    else:
        return params
    return params.replace(layers=params.layers.replace(experts=experts))


def _bf16_unused(experts, params, kernels: KernelConfig) -> str:
    """`choice.bf16_experts_unused` for these parameters (either expert layout), by the experts each device holds:
    split over a mesh, each device runs the MoE kernels on its own (120b over 4 devices: 32 each, grouped)."""
    D, I, E, _ = _moe_shape(experts, 1)
    leaf = jax.tree.leaves(experts)[0]  # [L, E, ...]
    E = leaf.sharding.shard_shape(leaf.shape)[1] if isinstance(leaf, jax.Array) else E
    return choice.bf16_experts_unused((D, I, E), params.embed.dtype, kernels.device, kernels)


def _bf16_too_big(kexp: KernelExperts) -> str:
    """Why the bf16 copy of `kexp` is not made here: its bytes on a device past half the memory free on the devices
    holding the experts (JAX's pool less what is in use; the other half stays for the KV cache and the activations:
    20b on an H200 takes 38.2 of ~118 GB, on an 80 GB GPU it would take 38.2 of ~59), or "" (also where devices
    report no memory, a CPU)."""
    L, E, _, I, W = kexp.gu_words.shape
    shard = kexp.gu_words.sharding.shard_shape(kexp.gu_words.shape)
    need = 3 * L * shard[1] * 8 * W * I * 2
    free = [s["bytes_limit"] - s.get("bytes_in_use", 0) for s in map(_memory_stats, kexp.gu_words.devices()) if s]
    if free and need > min(free) / 2:
        return (
            f"its {need / 1e9:.1f} GB a device ({3 * L * E * 8 * W * I * 2 / 1e9:.1f} GB in all) would take more than "
            f"half of the {min(free) / 1e9:.1f} GB free, which the KV cache needs"
        )
    return ""


def _memory_stats(device) -> dict | None:
    stats = device.memory_stats() or {}
    return stats if "bytes_limit" in stats else None


def with_bf16_experts(kexp: KernelExperts, *, interpret: bool = False) -> KernelExperts:
    """`kexp` (stacked `[L, E, ...]`) with its bf16 copy stored (`KernelExperts.gu_bf16`, `dn_bf16`: each layer's
    `moe_dense.dequantize_experts`, the function the grouped GEMMs otherwise run every call, so the same bits), made
    one layer at a time into preallocated buffers: the peak is the copy plus one layer's. Experts split over a mesh
    stay split: each device dequantizes its own, into its share of the copy (the MXFP4 experts' partition)."""
    L = kexp.gu_words.shape[0]
    words = (kexp.gu_words, kexp.gu_scales, kexp.dn_words, kexp.dn_scales)
    one = functools.partial(moe_dense.dequantize_experts, interpret=interpret)
    where = _expert_placement(kexp.gu_words.sharding)
    if where is not None:  # per device: its experts of the layer (a Pallas call is not partitioned by XLA)
        spec = where.spec
        one = jax.shard_map(
            one,
            mesh=where.mesh,
            in_specs=(spec,) * 4 + (jax.sharding.PartitionSpec(),),
            out_specs=(jax.sharding.PartitionSpec(*spec[1:]),) * 2,
            check_vma=False,
        )
    make = jax.jit(one)
    shapes = jax.eval_shape(make, *words, jnp.int32(0))
    bufs = [jnp.zeros((L, *s.shape), s.dtype, device=where) for s in shapes]
    for layer in range(L):
        for i, x in enumerate(make(*words, jnp.int32(layer))):
            bufs[i] = put_layer(bufs[i], x, layer)
    return kexp.replace(gu_bf16=bufs[0], dn_bf16=bufs[1])


def with_scale_operands(kexp: KernelExperts) -> KernelExperts:
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


# ---- attention ---------------------------------------------------------------------------------------------------


def attention(
    q_BTNH,
    k_pages_PSKH,
    v_pages,
    block_tables_BM,
    q_pos_BT,
    sinks_N,
    window: int,
    *,
    k_scale_PKS=None,
    v_scale_PKS=None,
    kernels: KernelConfig,
):
    """Paged attention with sinks (FP8 pools with their `kv_quant` scales, values `[P, K, H, S]`); the contract is in
    docs/engine.md ("Kernel interface")."""
    args = (q_BTNH, k_pages_PSKH, v_pages, block_tables_BM, q_pos_BT, sinks_N, window)
    scales = dict(k_scale_PKS=k_scale_PKS, v_scale_PKS=v_scale_PKS)
    B, T, N, H = q_BTNH.shape
    c = _choose("attention", B, (T, N, k_pages_PSKH.shape[2], H), k_pages_PSKH.dtype, kernels)
    if c.kernel == "reference":
        return attention_reference.attention(*args, **scales)
    if T > 1 and c.kernel in ("paged_rows", "new_token"):  # one decode query row per token, each with its row's
        # table and own position (the new-token kernel is `attention_new_token`'s; here the K/V are written already)
        rows = (q_BTNH.reshape(B * T, 1, N, H), k_pages_PSKH, v_pages, jnp.repeat(block_tables_BM, T, axis=0))
        o = paged_attention.attention(*rows, q_pos_BT.reshape(B * T, 1), sinks_N, window, **scales, **c.kw)
        return o.reshape(B, T, N, H)
    kernel = flash_attention if c.kernel == "flash" else paged_attention  # prefill chunk / decode
    return kernel.attention(*args, **scales, **c.kw)


def fuses_new_token(q_shape_BTNH: tuple, num_kv_heads: int, kv_dtype, kernels: KernelConfig) -> bool:
    """Whether decode of this shape over a KV cache of `kv_dtype` takes `attention_new_token` (with the kernels, up
    to `KernelConfig.new_token_rows` tokens, `attention_rows_tokens` a row at most)."""
    B, T, N, H = q_shape_BTNH
    return _choose("attention", B, (T, N, num_kv_heads, H), kv_dtype, kernels).kernel == "new_token"


def attention_new_token(
    t_BI,
    ws_LOI,
    bs_LO,
    layer,
    cos_BF,
    sin_BF,
    k_pages_PSKH,
    v_pages,
    block_tables_BM,
    page_offset,
    q_pos_B,
    write_page_B,
    write_slot_B,
    sinks_LN,
    window: int,
    done_BK,
    *,
    k_scale_PKS=None,
    v_scale_PKS=None,
    null_page: int,
    kernels: KernelConfig,
):
    """Decode with the kernels, one token or a few per row of `block_tables_BM` (`t_BI` holds R = B x T tokens, a
    row's together): the q, k and v projections of the normed `t_BI` (weights and biases stacked over layers,
    `linear_partials`), then `paged_attention.attention_new_token` (their sums, biases and RoPE, the cache write, the
    attention and the merge of its splits in one launch, counted in `done_BK`) -> (`[R, 1, N, H]`, k pages, v pages,
    done_BK, k scales, v scales) (FP8 pools: their scales)."""
    B, H, K = block_tables_BM.shape[0], k_pages_PSKH.shape[-1], k_pages_PSKH.shape[2]
    T = t_BI.shape[0] // B
    c = _choose("attention", B, (T, ws_LOI[0].shape[1] // H, K, H), k_pages_PSKH.dtype, kernels)
    parts = linear_partials(t_BI, ws_LOI, layer, kernels=kernels)
    return paged_attention.attention_new_token(
        parts,
        tuple(bs_LO),
        layer,
        cos_BF,
        sin_BF,
        k_pages_PSKH,
        v_pages,
        block_tables_BM,
        page_offset,
        q_pos_B,
        write_page_B,
        write_slot_B,
        sinks_LN,
        window,
        done_BK,
        k_scale_PKS=k_scale_PKS,
        v_scale_PKS=v_scale_PKS,
        null_page=null_page,
        tokens_per_row=T,
        **c.kw,
    )


# ---- projections -------------------------------------------------------------------------------------------------


def linear(x_TI, w_LOI, b_O, layer, *, kernels: KernelConfig):
    """`x @ w[layer].T + b` in fp32, for a weight stacked over layers: `linear_many` of one weight."""
    return linear_many(x_TI, (w_LOI,), (b_O,), layer, kernels=kernels)[0]


def linear_many(x_TI, ws_LOI, bs_O, layer, *, kernels: KernelConfig):
    """`linear` of the same x by several weights (q, k, v) -> a tuple: `linear_partials` summed with the biases."""
    parts = linear_partials(x_TI, ws_LOI, layer, kernels=kernels)
    return tuple(jnp.sum(y, axis=0) + b.astype(jnp.float32) for y, b in zip(parts, bs_O))


def linear_partials(x_TI, ws_LOI, layer, *, kernels: KernelConfig):
    """`x @ w[layer].T` for each weight, as fp32 partial sums `[splits, T, O]` whose sum (plus the bias) the
    consumer fuses: the Mosaic kernel (one launch for all weights, one split: it accumulates in place), the
    Triton GEMV (all weights in one launch, or one launch each), or XLA's GEMM (`choice.choose`)."""
    T, I = x_TI.shape
    c = _choose("projection", T, (I, *(w.shape[1] for w in ws_LOI)), ws_LOI[0].dtype, kernels)
    if c.kernel == "mosaic":
        zeros = tuple(jnp.zeros(w.shape[1], jnp.float32) for w in ws_LOI)
        return tuple(y[None] for y in linear_mosaic.linear_many(x_TI, tuple(ws_LOI), zeros, layer, **c.kw))
    if c.kernel == "gemv":
        launch = c.kw
        if launch.pop("fuse"):
            return linear_decode.partial_sums(x_TI, tuple(ws_LOI), layer, **launch)
        return tuple(linear_decode.partial_sums(x_TI, (w,), layer, **launch)[0] for w in ws_LOI)
    return tuple(linear_decode.reference(x_TI, w, jnp.zeros(w.shape[1], jnp.float32), layer)[None] for w in ws_LOI)


# ---- mixture of experts ------------------------------------------------------------------------------------------

# Each kernel module's `experts` keeps one contract: routing given, `layer` indexing stacked experts in place,
# pairs outside `valid_TK` skipped.
_EXPERTS = {
    "gemv16": functools.partial(moe_gemv.experts, half=True),
    "gemv": functools.partial(moe_gemv.experts, half=False),
    "mma": moe_mma.experts,
    "mosaic": moe_mosaic.experts,
    "dense": moe_dense.experts,
    "grouped": moe_dense.experts_grouped,
}


def _moe_shape(experts_all, top_k: int) -> tuple[int, int, int, int]:
    """(hidden, intermediate, experts, top-k) of either expert layout, stacked over layers or not."""
    if isinstance(experts_all, KernelExperts):
        E, _, I, _ = experts_all.gu_words.shape[-4:]
        return experts_all.dn_words.shape[-2], I, E, top_k
    E, I2, G, _ = experts_all.gate_up_blocks.shape[-4:]
    return 32 * G, I2 // 2, E, top_k


def experts(
    x_TD, idx_TK, w_TK, experts_all, layer, valid_TK=None, *, swiglu_limit, swiglu_alpha, kernels: KernelConfig
):
    """`sum_k w[t, k] * expert_{idx[t, k]}(x[t])` in fp32 for given routing, with the stacked experts and `layer`
    as in `moe`, by the kernel `choice.choose` picks for that many tokens. Pairs outside `valid_TK` (bool) must
    carry weight 0; the kernels skip them (the reference computes them)."""
    kw = dict(swiglu_limit=float(swiglu_limit), swiglu_alpha=float(swiglu_alpha))
    layer = None if layer is None else layer_index.value(layer)  # these kernels take the layer number
    if _resolved(kernels).impl == "reference":
        one = jax.tree.map(lambda a: a[layer], experts_all)
        return moe_reference.apply_experts(x_TD, idx_TK, w_TK, one, **kw)
    return _kernel_experts(x_TD, idx_TK, w_TK, experts_all, layer, valid_TK, kernels=kernels, **kw).astype(jnp.float32)


def _kernel_experts(x_TD, idx_TK, w_TK, experts_all, layer, valid_TK, *, kernels, **kw):
    """The experts on the kernels `choice.choose` picks, in the dtype of `x_TD`."""
    c = _choose("experts", idx_TK.shape[0], _moe_shape(experts_all, idx_TK.shape[1]), x_TD.dtype, kernels)
    return _EXPERTS[c.kernel](x_TD, idx_TK, w_TK, experts_all, layer, valid_TK, **kw, **c.kw)


def moe(
    x_TD, router_w_ED, router_b_E, experts_all, *, top_k, swiglu_limit, swiglu_alpha, layer=None, kernels: KernelConfig
):
    """Top-k MXFP4 experts; `experts_all` is `params.Experts` (reference) or `KernelExperts` (kernels), of one
    layer, or of all layers stacked with `layer` (traced) choosing one: the kernels then index the stacked
    arrays directly, so no per-layer copy of the experts is made."""
    kw = dict(top_k=top_k, swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha)
    layer = None if layer is None else layer_index.value(layer)  # these kernels take the layer number
    if _resolved(kernels).impl == "reference":
        if layer is not None:
            experts_all = jax.tree.map(lambda a: a[layer], experts_all)
        return moe_reference.moe(x_TD, router_w_ED, router_b_E, experts_all, **kw)
    idx, w, _ = moe_reference.route(x_TD, router_w_ED, router_b_E, top_k)
    return _kernel_experts(
        x_TD,
        idx,
        w,
        experts_all,
        layer,
        None,
        kernels=kernels,
        swiglu_limit=float(swiglu_limit),
        swiglu_alpha=float(swiglu_alpha),
    )


def moe_block(
    x_TD,
    norm_LD,
    router_w_LED,
    router_b_LE,
    experts_all,
    layer,
    next_gains,
    *,
    eps,
    dtype,
    top_k,
    swiglu_limit,
    swiglu_alpha,
    kernels: KernelConfig,
):
    """The MoE layer on the fp32 residual stream `x_TD` with its residual add, and the next block's norm: `rms_norm`
    with layer `layer`'s gain, `moe`, the sum with `x_TD`, and its `rms_norm` with the next gain (`next_gains` =
    (attention gains `[L, D]`, final gain `[D]`): row `layer + 1` of the first, or the second after the last
    layer); all weights stacked over layers. Returns (x `[T, D]` f32, its norm in `dtype`). For a few decode
    tokens of a bf16 model the kernels run `moe_route.moe`: its front end (norm, routing and the GEMV operand in
    one launch), the experts, and its back end (expert sum, residual add and the next norm in one launch)."""
    kw = dict(top_k=top_k, swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha)
    c = _choose("moe", x_TD.shape[0], _moe_shape(experts_all, top_k), dtype, kernels)
    if c.kernel == "route":
        return moe_route.moe(
            x_TD, norm_LD, router_w_LED, router_b_LE, experts_all, layer, next_gains, eps=eps, dtype=dtype, **kw, **c.kw
        )
    layer = layer_index.value(layer)
    t = rms_norm(x_TD, norm_LD[layer], eps, dtype)
    x = x_TD + moe(t, router_w_LED[layer], router_b_LE[layer], experts_all, layer=layer, kernels=kernels, **kw).astype(
        jnp.float32
    )
    return x, rms_norm(x, next_gain(*next_gains, layer), eps, dtype)


def next_gain(gain_LD, final_D, layer):
    """The norm gain of the block after layer `layer`'s MoE: layer `layer + 1`'s attention gain, or the final one."""
    L, layer = gain_LD.shape[0], layer_index.value(layer)
    return jnp.where(layer + 1 < L, gain_LD[jnp.minimum(layer + 1, L - 1)], final_D)
