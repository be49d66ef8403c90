"""The inspection API: `LLM.inspect` / `model.forward(..., inspect=Inspect())` (gptoss_jax/inspection.py)."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from parity_configs import PARITY, _config

import pallas_kernels
from gptoss_jax import LLM, SamplingParams, inspection, model, random_weights
from pallas_kernels import rope

CHUNK = 16  # prefill chunk: a 40-token sequence runs as 3 chunks, past the 16-key window of "wide"


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    spec = PARITY["wide"]
    path = tmp_path_factory.mktemp("inspect-wide")
    random_weights.write_checkpoint(
        path, spec["config"], seed=spec["seed"], sink_scale=spec["sink_scale"], progress=False
    )
    return LLM(
        path,
        dtype="float32",
        progress=False,
        prefill_chunk_size=CHUNK,
        min_prefill_bucket=CHUNK,
        page_size=4,
        min_context_bucket=64,
    )


def _ids(n=40, vocab=384, seed=0):
    return np.random.default_rng(seed).integers(2, vocab, n).tolist()


def test_shapes_and_layer_types(wide):
    cfg, ids = wide.config, _ids()
    ins = wide.inspect(ids)
    L, T, E, k, N = cfg.num_layers, len(ids), cfg.num_experts, cfg.experts_per_token, cfg.num_heads
    assert ins.router_logits.shape == (L, T, E) and ins.router_logits.dtype == np.float32
    assert ins.expert_ids.shape == (L, T, k) and ins.expert_weights.shape == (L, T, k)
    assert ins.sink_mass.shape == (L, T, N)
    assert ins.hidden_states is None and ins.logits is None
    assert ins.sliding.tolist() == [True, False, True, False] and ins.window == cfg.sliding_window
    assert ins.token_ids.tolist() == ids
    assert ins.expert_load().sum() == L * T * k and ins.expert_load().shape == (L, E)
    ent = ins.router_entropy()
    assert ent.shape == (L, T) and np.all(ent >= 0) and np.all(ent <= np.log(E) + 1e-5)


def test_chosen_experts_are_top_k_of_router_logits(wide):
    ins = wide.inspect(_ids(seed=1))
    k = wide.config.experts_per_token
    top = np.argsort(-ins.router_logits, axis=-1, kind="stable")[..., :k]
    np.testing.assert_array_equal(ins.expert_ids, top)
    chosen = np.take_along_axis(ins.router_logits, ins.expert_ids, axis=-1)
    w = np.exp(chosen - chosen.max(-1, keepdims=True))
    np.testing.assert_allclose(ins.expert_weights, w / w.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_routing_equals_what_the_serving_path_used(wide, monkeypatch):
    """Capture the experts the ordinary (inspection-off) prompt-logits program routes to, layer by layer,
    from inside its jitted MoE, and compare with what `inspect` reports."""
    captured = []
    real = pallas_kernels.moe

    def spy(x_TD, router_w_ED, router_b_E, experts, *, top_k, **kw):
        idx, _, _ = pallas_kernels.moe_reference.route(x_TD, router_w_ED, router_b_E, top_k)
        jax.debug.callback(lambda a: captured.append(np.asarray(a)), idx, ordered=True)
        return real(x_TD, router_w_ED, router_b_E, experts, top_k=top_k, **kw)

    monkeypatch.setattr(pallas_kernels, "moe", spy)
    jax.clear_caches()
    try:
        ids = _ids(seed=2)
        wide.logits(ids)
        jax.effects_barrier()
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    L = wide.config.num_layers
    chunks = [ids[s : s + CHUNK] for s in range(0, len(ids), CHUNK)]
    assert len(captured) == L * len(chunks)
    served = np.stack(
        [np.concatenate([captured[c * L + l][: len(ch)] for c, ch in enumerate(chunks)]) for l in range(L)]
    )
    np.testing.assert_array_equal(wide.inspect(ids).expert_ids, served)


def test_logits_unchanged_by_inspection(wide):
    ids = _ids(seed=3)
    ins = wide.inspect(ids, logits=True, hidden_states=True)
    np.testing.assert_allclose(ins.logits, wide.logits(ids), rtol=1e-6, atol=1e-6)
    # the last hidden state is the residual stream the final norm and unembedding turn into those logits
    p, cfg = wide.params, wide.config
    x = model.rms_norm(jnp.asarray(ins.hidden_states[-1]), p.final_norm, cfg.rms_norm_eps, jnp.float32)
    np.testing.assert_allclose(np.asarray(model.unembed(p, x)), ins.logits, rtol=1e-4, atol=1e-4)


def test_sink_mass_in_unit_interval_and_equals_dense_layer0(wide):
    """Layer 0 sees only embeddings, so its sink mass can be recomputed densely: p_sink = e^s / (e^s + sum_j e^qk)."""
    ids = _ids(seed=4)
    ins = wide.inspect(ids)
    assert np.all(ins.sink_mass >= 0) and np.all(ins.sink_mass <= 1)
    cfg, p = wide.config, wide.params
    N, K, H, T = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, len(ids)
    lp = jax.tree.map(lambda a: a[0], p.layers)
    t = model.rms_norm(p.embed[jnp.asarray(ids)], lp.attn_norm, cfg.rms_norm_eps, jnp.float32)
    cos, sin = rope.cos_sin(cfg, jnp.arange(T), jnp.float32)
    q = rope.apply((t @ lp.q_w.T + lp.q_b).reshape(T, N, H), cos, sin)
    k = rope.apply((t @ lp.k_w.T + lp.k_b).reshape(T, K, H), cos, sin)
    s = jnp.einsum("tnh,jnh->ntj", q, jnp.repeat(k, N // K, axis=1)) * H**-0.5
    i, j = np.arange(T)[:, None], np.arange(T)[None]
    s = jnp.where((j <= i) & (i - j < cfg.sliding_window), s, -jnp.inf)
    full = jnp.concatenate([s, jnp.broadcast_to(lp.sinks[:, None, None], (N, T, 1))], axis=-1)
    want = np.asarray(jax.nn.softmax(full, axis=-1)[..., -1]).T  # [T, N]
    np.testing.assert_allclose(ins.sink_mass[0], want, rtol=1e-4, atol=1e-5)


def test_odd_layer_count(tmp_path):
    cfg = _config(
        num_hidden_layers=3,
        num_local_experts=4,
        num_experts_per_tok=2,
        experts_per_token=2,
        vocab_size=256,
        hidden_size=32,
        intermediate_size=32,
        head_dim=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=8,
        eos_token_id=1,
        pad_token_id=0,
    )
    random_weights.write_checkpoint(tmp_path, cfg, seed=5, progress=False)
    llm = LLM(tmp_path, dtype="float32", progress=False)
    ins = llm.inspect(_ids(20, 256), hidden_states=True, logits=True)
    assert ins.sliding.tolist() == [True, False, True] and ins.hidden_states.shape == (3, 20, 32)
    np.testing.assert_array_equal(ins.expert_ids, np.argsort(-ins.router_logits, -1, kind="stable")[..., :2])
    np.testing.assert_allclose(ins.logits, llm.logits(_ids(20, 256)), rtol=1e-6, atol=1e-6)


def _forward_args(llm, T=CHUNK):
    cfg = llm.config
    cache = model.PagedKVCache.zeros(cfg, 9, 9, 4, jnp.float32)
    table = jnp.arange(1, 5, dtype=jnp.int32)[None]
    tables = model.PageTables(table, table, jnp.zeros((1,), jnp.int32))
    return (llm.params, cache, jnp.asarray([_ids(T)], jnp.int32), jnp.arange(T, dtype=jnp.int32)[None], tables)


def test_disabled_costs_nothing(wide):
    """Off (the default) the forward returns what it always did, and compiles to the same cost as the
    inspected forward with its records thrown away: the option adds no work when off."""
    cfg, args = wide.config, _forward_args(wide)
    off = jax.jit(lambda *a: model.forward(*a, cfg=cfg))
    assert jax.eval_shape(off, *args)[2] is None
    dropped = jax.jit(lambda *a: model.forward(*a, cfg=cfg, inspect=model.Inspect(hidden_states=True))[:2] + (None,))
    on = jax.jit(lambda *a: model.forward(*a, cfg=cfg, inspect=model.Inspect(hidden_states=True)))
    assert len(jax.eval_shape(on, *args)) == 3

    def cost(f):
        c = f.lower(*args).compile().cost_analysis()
        c = c[0] if isinstance(c, list) else c
        return {k: c[k] for k in ("flops", "transcendentals") if k in c}

    assert cost(off) and cost(off) == cost(dropped)
    # and serving never traces the inspection program
    before = dict(inspection.TRACES)
    wide.generate(
        prompt_token_ids=[_ids(10)], sampling_params=SamplingParams(temperature=0, max_tokens=2), use_tqdm=False
    )
    assert dict(inspection.TRACES) == before


def test_compiled_once_per_bucket(wide):
    wide.inspect(_ids(12, seed=6))
    before = dict(inspection.TRACES)
    wide.inspect(_ids(13, seed=7))  # same chunk bucket and table width
    assert dict(inspection.TRACES) == before


def test_rejects_bad_ids(wide):
    with pytest.raises(ValueError, match="inspect"):
        wide.inspect([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        wide.inspect([1, 10**6])


@pytest.mark.slow  # the whole model on the interpreted kernels
def test_inspection_through_the_kernels(small_checkpoint):
    """With the Pallas kernels (interpreted on CPU) the inspected forward is still the serving one: its
    logits equal `logits`, and the routing matches the reference path's on a prompt without near-ties."""
    g = np.load(Path(__file__).parent / "golden" / "small.npz", allow_pickle=False)
    ids = g["prompt_ids"].tolist()
    kern = LLM(small_checkpoint, dtype="float32", impl="pallas", progress=False)
    ins = kern.inspect(ids, logits=True)
    np.testing.assert_allclose(ins.logits, kern.logits(ids), rtol=1e-6, atol=1e-6)
    ref = LLM(small_checkpoint, dtype="float32", impl="reference", progress=False).inspect(ids)
    np.testing.assert_array_equal(ins.expert_ids, ref.expert_ids)
    # layer 0 sees the same inputs on both paths; later layers inherit the MoE kernels' rounding
    np.testing.assert_allclose(ins.sink_mass[0], ref.sink_mass[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ins.sink_mass, ref.sink_mass, atol=1e-2)
