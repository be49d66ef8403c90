"""The layer index as the layer scan's counter (`pallas_kernels.layer_index`): its map, and a decode step whose
layer scan leaves every layer number and page offset to its kernels (the kernels' own tests take it too)."""

import jax
import jax.extend
import jax.numpy as jnp
import pytest

from pallas_kernels import layer_index


def test_a_layer_index_maps_the_counter_to_its_layer_and_first_page():
    full = layer_index.LayerIndex(jnp.int32(3), 2, 1, pages=11)
    assert int(full.value()) == 7 and int(full.page_offset()) == 33
    assert int(layer_index.value(5)) == 5 and int(layer_index.of(5).page_offset()) == 0
    i, m = layer_index.operands(full)
    assert i.tolist() == [3] and m.tolist() == [2, 1, 11, 0]  # what the kernels read: 3 * 2 + 1, 3 * 11 + 0
    assert layer_index.operands(5, page_offset=40)[1].tolist() == [1, 0, 0, 40]
    leaves, tree = jax.tree.flatten(full)  # through jit: the counter traced, the map static
    assert len(leaves) == 1 and jax.tree.unflatten(tree, [jnp.int32(4)]).value() == 9
    assert layer_index.live_operand(full).tolist() == [1]  # no flag: live
    # the second pair of a scan step of two: layer 4 * 3 + 3, full-layer pages from (2 * 3 + 1) * 11
    second = layer_index.LayerIndex(jnp.int32(3), 4, 3, pages=22, first_page=11)
    assert int(second.value()) == 15 and int(second.page_offset()) == 77
    assert layer_index.operands(second)[1].tolist() == [4, 3, 22, 11]
    dead = layer_index.LayerIndex(jnp.int32(3), 2, 1, live=jnp.asarray([0], jnp.int32))
    assert layer_index.live_operand(dead).tolist() == [0] and len(jax.tree.leaves(dead)) == 2


def _subjaxprs(eqn):
    for v in eqn.params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(x, jax.extend.core.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jax.extend.core.Jaxpr):
                yield x


def _outside_kernels(jaxpr):
    """The equations of `jaxpr` and of the functions it calls, not those inside kernels."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            continue
        yield eqn
        for sub in _subjaxprs(eqn):
            yield from _outside_kernels(sub)


@pytest.mark.parametrize("batch, layers_a_step", [(1, 4), (2, 2)])
def test_the_verify_step_computes_no_layer_index_outside_its_kernels(batch, layers_a_step):
    """The 20b verify step for the H200 (traced, not run): its layer scan takes two layer pairs a step at batch 1
    (4 tokens: `KernelConfig.scan_pairs_tokens`) and one at batch 2, and its body, kernels aside, does no int32
    scalar arithmetic but its counter's increment (the live flag is computed once, outside the scan). XLA ran each
    such scalar (2i + 1, the attention kernel's [page offset, layer]) as a one-thread kernel on the step's critical
    path, four a layer pair (BENCHMARKS §26.6), and the increment itself costs one a scan step (§34)."""
    from gptoss_jax import speculative
    from tools import common, inspect_kernels

    cfg = common.model_config("gpt-oss-20b")
    spec = speculative.SpeculativeConfig("oracle", 3)
    drafter = speculative.make_drafter(spec, cfg.vocab_size, 2048)
    kernels = inspect_kernels.BASE.for_device(inspect_kernels.H200)
    shapes = common.param_shapes(cfg, "pallas")
    step = common.speculative_step(shapes, cfg, batch, 1024, kernels, drafter, draft_params=drafter.params(spec))
    scans = [
        e
        for e in _outside_kernels(step.trace().jaxpr)
        if e.primitive.name == "scan" and e.params["length"] == cfg.num_layers // layers_a_step
    ]
    assert len(scans) == 1
    body = scans[0].params["jaxpr"]
    # each layer's 7 launches: q/k/v, attention, o, the MoE's front, gate/up, down and back
    assert str(body).count("pallas_call[") == layers_a_step * 7
    scalar_ints = [
        (e.primitive.name, str(v.aval))
        for e in _outside_kernels(body.jaxpr)
        if e.primitive.name in ("add", "sub", "mul", "concatenate")
        for v in e.outvars
        if v.aval.dtype == jnp.int32 and v.aval.size <= 2
    ]
    assert scalar_ints == [("add", "int32[]")]  # the counter's own increment, carried
