"""One host of a 2-process CPU job (run by tests/test_distributed.py): expert-parallel MoE over a
mesh spanning both processes must equal the single-device result."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from sharding import distributed, expert_parallel
from sharding.rules import Layout, make_mesh


def main(port: str, pid: int, ckpt: str) -> None:
    assert distributed.initialize(f"127.0.0.1:{port}", 2, pid)
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    from gptoss_jax import checkpoint
    from pallas_kernels import moe_reference

    cfg, params = checkpoint.load_params(ckpt, jnp.float32, progress=False)
    lp = jax.tree.map(lambda a: a[0], params.layers)  # layer 0: its router; the experts stay stacked
    kw = dict(top_k=cfg.experts_per_token, swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha)
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (16, cfg.hidden_size), jnp.float32))
    ref = np.asarray(moe_reference.moe(jnp.asarray(x), lp.router_w, lp.router_b, lp.experts, **kw))

    layout = Layout(make_mesh(4, 2), "max_throughput")
    token_sharding = layout.sharding(("batch", None), cfg.num_kv_heads)
    xs = jax.make_array_from_callback(x.shape, token_sharding, lambda idx: x[idx])
    experts = expert_parallel.pad_experts(params.layers.experts, 4)
    rep = jax.sharding.NamedSharding(layout.mesh, jax.sharding.PartitionSpec())
    put = lambda a: jax.make_array_from_callback(a.shape, rep, lambda idx: np.asarray(a)[idx])
    out = jax.jit(lambda *a: expert_parallel.moe(*a, **kw, layout=layout))(
        xs, put(lp.router_w), put(lp.router_b), jax.tree.map(put, experts), put(jnp.int32(0))
    )
    for shard in out.addressable_shards:
        np.testing.assert_allclose(np.asarray(shard.data), ref[shard.index], rtol=1e-5, atol=1e-5)
    print(f"process {pid}: ok")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
