"""Typed parameter pytrees. Layers are stacked on a leading axis so the model is one `lax.scan`.

Weights keep the checkpoint's `[out, in]` orientation, so loading is a copy, never a transpose.
Expert weights stay MXFP4-packed (uint8 codes + E8M0 scales): 4.25 bits per parameter on device.
Each leaf's logical axes are declared once, in `logical_axes`; `sharding/rules.py` maps them to
mesh axes. The types live here, below the kernels and the sharding rules, because both read them.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class Experts:
    gate_up_blocks: jax.Array  # u8  [L, E, 2I, D/32, 16]  gate = even rows, up = odd rows
    gate_up_scales: jax.Array  # u8  [L, E, 2I, D/32]
    gate_up_bias: jax.Array  #     [L, E, 2I]
    down_blocks: jax.Array  # u8  [L, E, D, I/32, 16]
    down_scales: jax.Array  # u8  [L, E, D, I/32]
    down_bias: jax.Array  #     [L, E, D]


@struct.dataclass
class Layers:
    attn_norm: jax.Array  # f32 [L, D]
    q_w: jax.Array  # [L, Nq*H, D]
    q_b: jax.Array  # [L, Nq*H]
    k_w: jax.Array  # [L, Nkv*H, D]
    k_b: jax.Array  # [L, Nkv*H]
    v_w: jax.Array  # [L, Nkv*H, D]
    v_b: jax.Array  # [L, Nkv*H]
    o_w: jax.Array  # [L, D, Nq*H]
    o_b: jax.Array  # [L, D]
    sinks: jax.Array  # f32 [L, Nq]
    mlp_norm: jax.Array  # f32 [L, D]
    router_w: jax.Array  # [L, E, D]
    router_b: jax.Array  # [L, E]
    experts: Experts


@struct.dataclass
class Params:
    embed: jax.Array  # [V, D]
    layers: Layers
    final_norm: jax.Array  # f32 [D]
    unembed: jax.Array  # [V, D]


def shapes(cfg, dtype=jnp.bfloat16) -> Params:
    """`jax.ShapeDtypeStruct` of every parameter (`cfg`: a `gptoss_jax.config.ModelConfig`): the single
    source of shapes and dtypes."""
    L, E, D, I, V = cfg.num_layers, cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    f32, u8 = jnp.float32, jnp.uint8

    def s(shape, dt=dtype):
        return jax.ShapeDtypeStruct(tuple(shape), dt)

    experts = Experts(
        gate_up_blocks=s((L, E, 2 * I, D // 32, 16), u8),
        gate_up_scales=s((L, E, 2 * I, D // 32), u8),
        gate_up_bias=s((L, E, 2 * I)),
        down_blocks=s((L, E, D, I // 32, 16), u8),
        down_scales=s((L, E, D, I // 32), u8),
        down_bias=s((L, E, D)),
    )
    layers = Layers(
        attn_norm=s((L, D), f32),
        q_w=s((L, nq, D)),
        q_b=s((L, nq)),
        k_w=s((L, nkv, D)),
        k_b=s((L, nkv)),
        v_w=s((L, nkv, D)),
        v_b=s((L, nkv)),
        o_w=s((L, D, nq)),
        o_b=s((L, D)),
        sinks=s((L, cfg.num_heads), f32),
        mlp_norm=s((L, D), f32),
        router_w=s((L, E, D)),
        router_b=s((L, E)),
        experts=experts,
    )
    return Params(embed=s((V, D)), layers=layers, final_norm=s((D,), f32), unembed=s((V, D)))


def logical_axes() -> Params:
    """Logical axis names of every parameter (same tree as `Params`)."""
    experts = Experts(
        gate_up_blocks=("layers", "experts", "expert_ffn2", "embed_blocks", None),
        gate_up_scales=("layers", "experts", "expert_ffn2", "embed_blocks"),
        gate_up_bias=("layers", "experts", "expert_ffn2"),
        down_blocks=("layers", "experts", "embed", "expert_ffn_blocks", None),
        down_scales=("layers", "experts", "embed", "expert_ffn_blocks"),
        down_bias=("layers", "experts", "embed"),
    )
    layers = Layers(
        attn_norm=("layers", "embed"),
        q_w=("layers", "q_heads", "embed"),
        q_b=("layers", "q_heads"),
        k_w=("layers", "kv_heads", "embed"),
        k_b=("layers", "kv_heads"),
        v_w=("layers", "kv_heads", "embed"),
        v_b=("layers", "kv_heads"),
        o_w=("layers", "embed", "q_heads"),
        o_b=("layers", "embed"),
        sinks=("layers", "heads"),
        mlp_norm=("layers", "embed"),
        router_w=("layers", "experts_replicated", "embed"),
        router_b=("layers", "experts_replicated"),
        experts=experts,
    )
    return Params(embed=("vocab", "embed"), layers=layers, final_norm=("embed",), unembed=("vocab", "embed"))


@functools.partial(jax.jit, donate_argnums=0)
def put_layer(buf: jax.Array, x: jax.Array, layer) -> jax.Array:
    """`buf[layer] = x` in place (`buf` donated): stacked leaves are filled one layer at a time."""
    return jax.lax.dynamic_update_index_in_dim(buf, x.astype(buf.dtype), layer, 0)


def nbytes(tree) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def field_paths(tree) -> list[tuple[str, ...]]:
    """Dotted attribute paths of a params tree, e.g. ('layers', 'experts', 'down_bias')."""
    out = []

    def walk(node, prefix):
        if dataclasses.is_dataclass(node):
            for f in dataclasses.fields(node):
                walk(getattr(node, f.name), prefix + (f.name,))
        elif node is not None:
            out.append(prefix)

    walk(tree, ())
    return out


def get_field(tree, field: tuple[str, ...]):
    for name in field:
        tree = getattr(tree, name)
    return tree


def with_field(tree, field: tuple[str, ...], value):
    """A copy of the dataclass tree with the leaf at `field` (a `field_paths` entry) replaced."""
    if len(field) == 1:
        return tree.replace(**{field[0]: value})
    return tree.replace(**{field[0]: with_field(getattr(tree, field[0]), field[1:], value)})
