"""All-to-all expert dispatch on 8 simulated CPU devices: the ragged all-to-all emulation against a
numpy model of `jax.lax.ragged_all_to_all`, and the dispatched MoE at the worst-case routing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from gptoss_jax import checkpoint
from pallas_kernels import moe_reference
from sharding import a2a_dispatch, expert_parallel, ragged
from sharding.rules import make_layout, make_mesh

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")


def _numpy_ragged_all_to_all(operands, outputs, input_offsets, send_sizes, output_offsets):
    """The send side of the documented semantics, device by device: slice i of device s goes to device
    i // (N / n), at that device's row `output_offsets[s][i]`."""
    n, N = len(operands), len(input_offsets[0])
    results = [o.copy() for o in outputs]
    for s in range(n):
        for i in range(N):
            a, size = input_offsets[s][i], send_sizes[s][i]
            results[i // (N // n)][output_offsets[s][i] : output_offsets[s][i] + size] = operands[s][a : a + size]
    return results


@pytest.mark.parametrize("slices_per_device", [1, 2])
def test_emulated_ragged_all_to_all_matches_the_numpy_model(slices_per_device):
    """2 groups of 4 devices (axis `model`), random ragged sizes with gaps, untouched rows kept."""
    reps, n, m, rows, out_rows = 2, 4, slices_per_device, 10, 48
    rng = np.random.default_rng(m)
    N = n * m
    send = rng.integers(0, 4, (reps, n, N))  # [group, source, slice]
    in_off = rng.integers(0, rows - 3, (reps, n, N))
    out_off, recv = np.zeros_like(send), np.zeros_like(send)
    for g in range(reps):
        for d in range(n):  # the slices landing on device d, in a random order with gaps
            incoming = [(s, i) for s in range(n) for i in range(d * m, (d + 1) * m)]
            at = 0
            for s, i in (incoming[j] for j in rng.permutation(len(incoming))):
                at += int(rng.integers(0, 2))
                out_off[g, s, i], at = at, at + send[g, s, i]
                recv[g, d, s * m + i % m] = send[g, s, i]
    operands = rng.normal(size=(reps, n, rows, 3)).astype(np.float32)
    outputs = np.full((reps, n, out_rows, 3), -7.0, np.float32)
    want = np.stack(
        [_numpy_ragged_all_to_all(operands[g], outputs[g], in_off[g], send[g], out_off[g]) for g in range(reps)]
    )

    mesh = make_mesh(n, reps)
    flat = lambda a: jnp.asarray(
        a.reshape(reps * n * a.shape[2], *a.shape[3:]), a.dtype if a.dtype != np.int64 else jnp.int32
    )
    fn = jax.shard_map(
        lambda *a: ragged.emulated(*a, axis_name="model"),
        mesh=mesh,
        in_specs=P(("replica", "model")),
        out_specs=P(("replica", "model")),
    )
    got = jax.jit(fn)(*map(flat, (operands, outputs, in_off, send, out_off, recv)))
    np.testing.assert_array_equal(np.asarray(got).reshape(want.shape), want)
    assert (want != -7.0).any() and (want == -7.0).any()  # both received and untouched rows are checked


def _moe_inputs(small_checkpoint, favour):
    """Layer 1 of the small model with its router biased so every token picks experts `favour`."""
    cfg, params = checkpoint.load_params(small_checkpoint, jnp.float32, progress=False)
    kw = dict(top_k=cfg.experts_per_token, swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha)
    lp = jax.tree.map(lambda a: a[1], params.layers)
    bias = lp.router_b.at[jnp.asarray(favour)].add(100.0)
    x = jax.random.normal(jax.random.PRNGKey(3), (24, cfg.hidden_size), jnp.float32)
    ref = moe_reference.moe(x, lp.router_w, bias, lp.experts, **kw)
    return params, lp.router_w, bias, x, kw, ref


def _run(layout, params, router_w, router_b, x, kw):
    experts = expert_parallel.pad_experts(params.layers.experts, layout.model_size)
    fn = jax.jit(lambda *a: expert_parallel.moe(*a, **kw, layout=layout))
    return np.asarray(fn(x, router_w, router_b, experts, jnp.int32(1)))


@pytest.mark.slow  # multi-device MoE at its worst-case routing
@pytest.mark.parametrize("model,replicas,favour", [(2, 4, [0, 1]), (3, 2, [1, 0])])
def test_all_to_all_drops_nothing_at_the_worst_case(small_checkpoint, monkeypatch, model, replicas, favour):
    """Every token routed to one device's experts fills its receive buffer exactly: the result equals one
    device's and the all-gather dispatch's; with one row less the buffer would drop a pair."""
    params, rw, rb, x, kw, ref = _moe_inputs(small_checkpoint, favour)
    a2a = make_layout(model, replicas, "max_throughput", dispatch="all_to_all")
    got = _run(a2a, params, rw, rb, x, kw)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    ag = _run(make_layout(model, replicas, "max_throughput"), params, rw, rb, x, kw)
    np.testing.assert_allclose(got, ag, rtol=1e-5, atol=1e-5)

    full = a2a_dispatch.capacity
    monkeypatch.setattr(a2a_dispatch, "capacity", lambda *a: full(*a) - 1)
    short = _run(make_layout(model, replicas, "max_throughput", dispatch="all_to_all"), params, rw, rb, x, kw)
    assert np.abs(short - ref).max() > 1e-2


def test_gpu_lowering_uses_two_ragged_all_to_alls(small_checkpoint, monkeypatch):
    """Off-GPU the emulation runs; with the native op selected the MoE lowers (not compiles: XLA:CPU
    cannot) to one `ragged_all_to_all` there and one back, and no all-gather of activations."""
    params, rw, rb, x, kw, _ = _moe_inputs(small_checkpoint, [0, 1])
    layout = make_layout(4, 2, "max_throughput", dispatch="all_to_all")
    experts = expert_parallel.pad_experts(params.layers.experts, 4)
    monkeypatch.setattr(ragged, "native", lambda mesh: True)
    text = (
        jax.jit(lambda *a: expert_parallel.moe(*a, **kw, layout=layout))
        .lower(x, rw, rb, experts, jnp.int32(1))
        .as_text()
    )
    assert text.count("ragged_all_to_all") == 2
    assert text.count("stablehlo.all_gather") == 1  # the [n] pair counts only
