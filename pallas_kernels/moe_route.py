"""The decode MoE's front and back ends, one Pallas-Triton kernel each. `front`: RMSNorm, router logits, and the
half-precision activation words that `moe_gemv`'s half-precision expert kernels read. `back`: the experts' sum, the
residual add and the next block's RMSNorm.

Why: at a few tokens per step each of these steps moves kilobytes, yet as XLA fusions they were nine launches
per layer (norm reduction, router dot, bias, top-k sort, softmax, the layer's expert offset, frexp, f16
packing, index iotas) of 1-2.4 us each: ~13 us of a 20b layer's ~110 us at batch 1 on an H200
(docs/BENCHMARKS.md §7b). Here they are one launch; top-k and softmax run in the `gemv16` gate/up kernel, which
routes each pair from the `[T, E]` logits (`moe_gemv._routed_pair`) and hands it to the down kernel.

Backend: Pallas-Triton, like the `gemv16` kernels that consume its output: per-element bit work (the exponent
of the row's largest value, f16 pairs packed into words), small reductions and gathers; and CPU interpret
mode runs this exact kernel in CI.

Grid (token, group of `experts_per_program` experts). A program loads its token's whole row and gain, its
experts' router rows and biases at once (none of these addresses depends on a loaded value, so the program
waits for one memory round trip: a first version that looped over the row in one program per token spent
~14 us a layer in that loop's latency), then:
- t = bf16((x * r) * gain) with r the RMS factor, as `rms_norm` rounds it; its f32 dot with the experts' rows;
- e, the frexp exponent of the row's largest |t| (from its f32 bits), and its share of the words: t at
  phase positions 8m + j and 8m + j + 4 (j < 4), re-read at those positions from L1/L2, times 2^(14 - e),
  packed as f16 pairs, exactly `moe_gemv.half_pairs`.

`back` is the same idea after the experts: one program per token loads its k expert rows, residual row and gain
at once and writes the new residual row and its norm, where XLA ran three kernels (the expert sum with the
residual add, the norm's reduction, its scaling) on the step's critical path: the step is 2.0-2.3% faster at
1 token (§7f). The decode step therefore carries each layer's input already normed (`model.forward`). Folding
this work into the down kernel's last program instead (a count, as `paged_attention._merge_splits`) gained
nothing: every one of its ~720 programs paid the barrier and atomic, and the last one the row's latency.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import layer_index, moe_gemv
from pallas_kernels.expert_format import KernelExperts, flatten_layers
from pallas_kernels.norm import rms_norm


def reference(x_TD, gain_LD, router_w_LED, router_b_LE, layer, *, eps: float, dtype):
    """What the kernel computes, with the model's own functions: the router logits `[T, E]` f32 (bias
    included) and `moe_gemv.half_pairs` of the normed rows (words `[T, 4, D/32, 4]` u32, factors `[T]` f32)."""
    layer = layer_index.value(layer)
    t = rms_norm(x_TD, gain_LD[layer], eps, dtype)
    logits = jnp.einsum("td,ed->te", t, router_w_LED[layer], preferred_element_type=jnp.float32)
    return (logits + router_b_LE[layer].astype(jnp.float32), *moe_gemv.half_pairs(t))


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _kernel(
    layer_ref, map_ref, x_ref, g_ref, rw_ref, rb_ref, logits_ref, words_ref, xs_ref, *, D, E, eb, mb, eps, dtype
):
    f32 = jnp.float32
    t, s = pl.program_id(0), pl.program_id(1)
    layer = layer_index.read(layer_ref, map_ref)
    cols = jnp.arange(_pow2(D))
    ok = cols < D
    # every load below depends on no loaded value: one memory round trip for the whole program
    x = plt.load(x_ref.at[t, pl.ds(0, _pow2(D))], mask=ok, other=0.0)
    g = plt.load(g_ref.at[layer, pl.ds(0, _pow2(D))], mask=ok, other=0.0)
    e_ids = s * eb + jnp.arange(eb)
    w = plt.load(
        rw_ref.at[layer, pl.ds(s * eb, eb), pl.ds(0, _pow2(D))], mask=(e_ids < E)[:, None] & ok[None, :], other=0
    )
    bias = plt.load(rb_ref.at[layer, pl.ds(s * eb, eb)], mask=e_ids < E, other=0)

    r = jax.lax.rsqrt(jnp.sum(x * x) / D + eps)

    def normed(xv, gv):  # rms_norm's rounding: (x * r) * gain in f32, then the model dtype
        return ((xv * r) * gv.astype(f32)).astype(dtype).astype(f32)

    tv = normed(x, g)
    logits = jnp.sum(w.astype(f32) * tv[None, :], axis=1) + bias.astype(f32)
    plt.store(logits_ref.at[t, pl.ds(s * eb, eb)], logits, mask=e_ids < E)

    # frexp(amax) exponent e (amax < 2^e) from the f32 bits; 0 for an all-zero row, as jnp.frexp
    amax = jnp.max(jnp.abs(tv))
    bits = jax.lax.bitcast_convert_type(amax, jnp.int32)
    e = jnp.where(amax > 0, jnp.maximum(((bits >> 23) & 255) - 126, -99), 0)
    scale = jax.lax.bitcast_convert_type((141 - e) << 23, f32)  # 2^(14 - e)

    @pl.when(s == 0)
    def _():
        xs_ref[t] = jax.lax.bitcast_convert_type((e + 127) << 23, f32)  # 2^e

    # this program's words m: phases j and j + 4 of t[8m + ...] re-read at gathered positions (L1/L2)
    jj, m = jnp.arange(4)[:, None], s * mb + jnp.arange(mb)[None, :]
    in_row = jnp.broadcast_to(m < D // 8, (4, mb))

    def half(offset):
        d = 8 * m + jj + offset
        tv = normed(
            plt.load(x_ref.at[t, d], mask=in_row, other=0.0), plt.load(g_ref.at[layer, d], mask=in_row, other=0.0)
        )
        return jax.lax.bitcast_convert_type((tv * scale).astype(jnp.float16), jnp.uint16).astype(jnp.uint32)

    plt.store(words_ref.at[t, pl.ds(0, 4), pl.ds(s * mb, mb)], half(0) | (half(4) << 16), mask=in_row)


@functools.partial(jax.jit, static_argnames=("eps", "dtype", "experts_per_program", "interpret"))
def front(
    x_TD, gain_LD, router_w_LED, router_b_LE, layer, *, eps: float, dtype, experts_per_program: int = 4, interpret=None
):
    """`reference`'s outputs from one launch: grid (tokens, expert groups); each program norms its token's row
    (all of it: the norm and the row's largest value need it), dots it with `experts_per_program` router rows
    and packs its share of the words. `layer` may be traced."""
    T, D = x_TD.shape
    E = router_w_LED.shape[1]
    groups = pl.cdiv(E, experts_per_program)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    logits, words, xs = pl.pallas_call(
        functools.partial(
            _kernel,
            D=D,
            E=E,
            eb=experts_per_program,
            mb=_pow2(pl.cdiv(D // 8, groups)),
            eps=float(eps),
            dtype=jnp.dtype(dtype),
        ),
        grid=(T, groups),
        name="moe_route",
        out_shape=(
            jax.ShapeDtypeStruct((T, E), jnp.float32),
            jax.ShapeDtypeStruct((T, 4, D // 8), jnp.uint32),
            jax.ShapeDtypeStruct((T,), jnp.float32),
        ),
        compiler_params=plt.CompilerParams(num_warps=8, num_stages=1),
        interpret=interpret,
    )(*layer_index.operands(layer), x_TD.astype(jnp.float32), gain_LD, router_w_LED, router_b_LE)
    return logits, words.reshape(T, 4, D // 32, 4), xs


def _back_kernel(layer_ref, map_ref, y_ref, x_ref, an_ref, fn_ref, xo_ref, to_ref, *, k: int, eps: float):
    f32 = jnp.float32
    t = pl.program_id(0)
    D, L = x_ref.shape[1], an_ref.shape[0]
    cols = pl.ds(0, _pow2(D))
    ok = jnp.arange(_pow2(D)) < D
    nxt = layer_index.read(layer_ref, map_ref) + 1
    # every load below depends on no loaded value: one memory round trip for the whole program
    ys = [plt.load(y_ref.at[t * k + j, cols], mask=ok, other=0.0) for j in range(k)]
    x = plt.load(x_ref.at[t, cols], mask=ok, other=0.0)
    g = plt.load(an_ref.at[jnp.minimum(nxt, L - 1), cols], mask=ok & (nxt < L), other=0.0).astype(f32) + plt.load(
        fn_ref.at[cols], mask=ok & (nxt >= L), other=0.0
    ).astype(f32)
    y = ys[0]
    for v in ys[1:]:
        y = y + v
    x = x + y.astype(to_ref.dtype).astype(f32)  # the experts' sum in the model dtype, as `moe_slots.combine`
    plt.store(xo_ref.at[t, cols], x, mask=ok)
    r = jax.lax.rsqrt(jnp.sum(x * x) / D + eps)
    plt.store(to_ref.at[t, cols], ((x * r) * g).astype(to_ref.dtype), mask=ok)  # `rms_norm`'s rounding


@functools.partial(jax.jit, static_argnames=("top_k", "eps", "dtype", "num_warps", "interpret"))
def back(y_PD, x_TD, next_gains, layer, *, top_k: int, eps: float, dtype, num_warps: int = 8, interpret=None):
    """The decode MoE's back end in one launch, one program per token: the sum of its `top_k` expert rows of
    `y_PD` (pairs in token order) in `dtype`, added to the residual row `x_TD`, and that row's `rms_norm` with the
    next block's gain (`next_gains` = (attention gains `[L, D]`, final gain `[D]`): row `layer + 1` of the first,
    or the second after the last layer) -> (x `[T, D]` f32, t `[T, D]` `dtype`). XLA spent three kernels on this
    (the expert sum with the residual add, the norm's reduction, its scaling)."""
    T, D = x_TD.shape
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return pl.pallas_call(
        functools.partial(_back_kernel, k=top_k, eps=float(eps)),
        grid=(T,),
        name="moe_residual_norm",
        out_shape=(jax.ShapeDtypeStruct((T, D), jnp.float32), jax.ShapeDtypeStruct((T, D), dtype)),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
    )(*layer_index.operands(layer), y_PD, x_TD.astype(jnp.float32), *next_gains)


def moe(
    x_TD,
    gain_LD,
    router_w_LED,
    router_b_LE,
    kexp_all: KernelExperts,
    layer,
    next_gains,
    *,
    top_k: int,
    eps: float,
    dtype,
    swiglu_limit,
    swiglu_alpha,
    experts_per_program: int,
    back_warps: int,
    gemv: dict,
    interpret=None,
):
    """The decode MoE block on the fp32 residual stream `x_TD`, with its residual add and the next block's norm:
    `front`, then the two half-precision GEMV kernels on the layer-stacked experts (`moe_gemv.run_routed` with the
    `gemv` launch settings: the gate/up programs route their (token, expert) pairs from the logits, top-k and
    softmax in-kernel), then `back`.
    Returns (x + moe(x) `[T, D]` f32, its `rms_norm` with the next gain in `dtype`), as
    `pallas_kernels.moe_block` computes them."""
    logits, words, xs = front(
        x_TD,
        gain_LD,
        router_w_LED,
        router_b_LE,
        layer,
        eps=eps,
        dtype=dtype,
        experts_per_program=experts_per_program,
        interpret=interpret,
    )
    y = moe_gemv.run_routed(
        words,
        xs,
        logits,
        layer,
        flatten_layers(kexp_all),
        top_k=top_k,
        swiglu_limit=float(swiglu_limit),
        swiglu_alpha=float(swiglu_alpha),
        interpret=interpret,
        **gemv,
    )
    return back(
        y, x_TD, next_gains, layer, top_k=top_k, eps=eps, dtype=dtype, num_warps=back_warps, interpret=interpret
    )
