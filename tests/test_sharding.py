"""Sharding on 8 simulated CPU devices (conftest sets --xla_force_host_platform_device_count=8)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gptoss_jax import checkpoint
from pallas_kernels import moe_reference
from sharding import expert_parallel
from sharding.rules import Layout, make_mesh

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")


def _layer_experts(params, layer):
    return jax.tree.map(lambda x: x[layer], params.layers.experts)


@pytest.mark.parametrize("mode,model,replicas", [("low_latency", 8, 1), ("max_throughput", 8, 1),
                                                 ("low_latency", 4, 2), ("max_throughput", 2, 4),
                                                 ("max_throughput", 3, 2)])
def test_expert_parallel_moe_matches_single_device(small_checkpoint, mode, model, replicas):
    cfg, params = checkpoint.load_params(small_checkpoint, jnp.float32, progress=False)
    assert cfg.num_experts % model or model in (2, 4, 8)  # E=4: 8 and 3 need padding
    layout = Layout(make_mesh(model, replicas), mode)
    T = 24  # divisible by replicas * model for every case
    x = jax.random.normal(jax.random.PRNGKey(model), (T, cfg.hidden_size), jnp.float32)
    lp = jax.tree.map(lambda a: a[1], params.layers)
    kw = dict(top_k=cfg.experts_per_token, swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha)
    ref = moe_reference.moe(x, lp.router_w, lp.router_b, lp.experts, **kw)

    experts = expert_parallel.pad_experts(lp.experts, model, axis=0)
    assert experts.gate_up_blocks.shape[0] == expert_parallel.padded_count(cfg.num_experts, model)
    token_axes = layout.rules(cfg.num_kv_heads)["batch"]
    out = jax.jit(lambda *a: expert_parallel.moe(*a, **kw, mesh=layout.mesh, token_axes=token_axes))(
        x, lp.router_w, lp.router_b, experts)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_param_shardings_follow_the_table(small_checkpoint):
    cfg, params = checkpoint.load_params(small_checkpoint, jnp.float32, progress=False)
    ll = Layout(make_mesh(2, 4), "low_latency").param_shardings(cfg.num_kv_heads)
    assert ll.layers.q_w.spec == jax.sharding.PartitionSpec(None, "model", None)
    assert ll.layers.k_w.spec == jax.sharding.PartitionSpec(None, "model", None)  # 2 KV heads / 2
    assert ll.layers.experts.down_blocks.spec[1] == "model" and ll.unembed.spec[0] == "model"
    big = Layout(make_mesh(8, 1), "low_latency").param_shardings(cfg.num_kv_heads)
    assert big.layers.k_w.spec == jax.sharding.PartitionSpec(None, None, None)  # 2 KV heads < 8: replicate
    mt = Layout(make_mesh(8, 1), "max_throughput").param_shardings(cfg.num_kv_heads)
    assert mt.layers.q_w.spec == jax.sharding.PartitionSpec(None, None, None)
    with pytest.raises(ValueError, match="unknown parallelism mode"):
        Layout(make_mesh(2), "fastest")
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh(8, 2)
