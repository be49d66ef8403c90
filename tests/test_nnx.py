"""The Flax NNX module `gptoss_jax.nnx.GptOss`: the engine's arrays, the engine's math, its sown intermediates."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gptoss_jax import LLM, checkpoint
from gptoss_jax.nnx import MXFP4, GptOss
from sharding.rules import make_mesh

GOLDEN = Path(__file__).parent / "golden"


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


T = 40  # every quick test's sequence length (the golden prompts' too): one compiled program serves them


def _ids(n, seed=0, vocab=512):
    return np.random.default_rng(seed).integers(2, vocab, n).tolist()


@pytest.fixture(scope="module")
def module(small_checkpoint):
    return GptOss.from_pretrained(small_checkpoint, dtype="float32", progress=False)


@pytest.fixture(scope="module")
def llm(small_checkpoint):
    return LLM(small_checkpoint, dtype="float32", progress=False)


def _same_arrays(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(x is y for x, y in zip(la, lb))


def test_variables_are_the_params_arrays(module):
    params = module.to_params()
    graphdef, state = nnx.split(module)
    assert len(jax.tree.leaves(state)) == len(jax.tree.leaves(params))
    pointers = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(params)}
    assert {x.unsafe_buffer_pointer() for x in jax.tree.leaves(state)} == pointers
    assert _same_arrays(nnx.merge(graphdef, state).to_params(), params)  # split, merge: the same arrays
    rebuilt = GptOss(module.config, params, kernels=module.kernels)  # Params -> module -> Params
    assert _same_arrays(rebuilt.to_params(), params)
    served = module.to_llm(progress=False)  # and the engine serves those very arrays
    assert _same_arrays(served.params, params)


def test_packed_experts_are_not_trainable_params(module):
    packed = jax.tree.leaves(nnx.state(module, MXFP4))
    trainable = jax.tree.leaves(nnx.state(module, nnx.Param))
    assert len(packed) == 4 and all(x.dtype == jnp.uint8 for x in packed)
    assert all(jnp.issubdtype(x.dtype, jnp.floating) for x in trainable)
    assert len(packed) + len(trainable) == len(jax.tree.leaves(module.to_params()))


@pytest.mark.parametrize("name", ["small", pytest.param("wide", marks=pytest.mark.slow)])
def test_logits_match_transformers_goldens(name, parity_checkpoints):
    g = np.load(GOLDEN / f"{name}.npz", allow_pickle=False)
    m = GptOss.from_pretrained(parity_checkpoints[name], dtype="float32", progress=False)
    logits = m(g["prompt_ids"])
    assert logits.shape == g["logits"].shape and logits.dtype == jnp.float32
    assert _rel(logits, g["logits"]) < 1e-4


def test_logits_match_the_engine(module, llm):
    ids = _ids(T, seed=1)
    assert _rel(module(jnp.asarray(ids)), llm.logits(ids)) < 1e-5


def test_padded_batch_rows_equal_the_engine(module, llm):
    a, b = _ids(T, seed=2), _ids(29, seed=3)
    tokens = jnp.asarray([a, b + [0] * (T - 29)])
    positions = jnp.asarray([list(range(T)), list(range(29)) + [-1] * (T - 29)])
    out = module(tokens, positions)
    assert out.shape == (2, T, 512)
    assert _rel(out[0], llm.logits(a)) < 1e-5 and _rel(out[1, :29], llm.logits(b)) < 1e-5


def test_intermediates_agree_with_llm_inspect(module, llm):
    ids = _ids(T, seed=4)
    logits, inter = nnx.capture(module, nnx.Intermediate)(jnp.asarray(ids), intermediates=True)
    ins = llm.inspect(ids, hidden_states=True, logits=True)
    mlp = inter["layers"]["mlp"]
    row0 = lambda v: np.asarray(v[0][:, 0])  # noqa: E731  (sown once: a 1-tuple of [L, B, T, ...])
    np.testing.assert_array_equal(row0(mlp["expert_ids"]), ins.expert_ids)
    np.testing.assert_allclose(row0(mlp["router_logits"]), ins.router_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(row0(mlp["expert_weights"]), ins.expert_weights, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(row0(inter["layers"]["attn"]["sink_mass"]), ins.sink_mass, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(row0(inter["layers"]["hidden_states"]), ins.hidden_states, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits, ins.logits, rtol=1e-5, atol=1e-5)
    assert ins.sink_mass.max() > 0.05  # the fixture's large sinks: a wrong sink mass would show


def test_intermediates_only_when_asked(module):
    _, inter = nnx.capture(module, nnx.Intermediate)(jnp.asarray(_ids(T)))
    assert not jax.tree.leaves(inter)


@pytest.mark.slow  # compiles the gradient and a serving engine
def test_router_lora_trains_alone_and_is_served(small_checkpoint):
    """A LoRA on the router, trained with plain `jax.grad` (base frozen) to send tokens to expert 0, changes the
    routing; `to_llm` serves it: the engine routes as the module does."""
    m = GptOss.from_pretrained(small_checkpoint, dtype="float32", progress=False)
    ids = jnp.asarray([_ids(T, seed=5)])
    base_logits = m(ids)
    m.layers.mlp.router.add_lora(2, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(m(ids), base_logits)  # b = 0: the update starts at zero
    graphdef, lora, rest = nnx.split(m, nnx.LoRAParam, ...)

    def loss(lora):
        _, inter = nnx.capture(nnx.merge(graphdef, lora, rest), nnx.Intermediate)(ids, intermediates=True)
        return -jax.nn.log_softmax(inter["layers"]["mlp"]["router_logits"][0], -1)[..., 0].mean()

    step = jax.jit(jax.value_and_grad(loss))
    first, _ = step(lora)
    for _ in range(5):
        value, grads = step(lora)
        lora = jax.tree.map(lambda p, g: p - 2.0 * g, lora, grads)
    assert float(loss(lora)) < 0.5 * float(first)
    nnx.update(m, lora)
    _, inter = nnx.capture(m, nnx.Intermediate)(ids, intermediates=True)
    chosen = np.asarray(inter["layers"]["mlp"]["expert_ids"][0][:, 0])
    assert (chosen == 0).any(-1).mean() > 0.9
    served = m.to_llm(progress=False)
    np.testing.assert_array_equal(served.inspect(ids[0].tolist()).expert_ids, chosen)
    base = m.to_params()
    assert served.params.layers.q_w is base.layers.q_w  # only the router weight is new (base + LoRA)
    assert served.params.layers.router_w is not m.layers.mlp.router.weight[...]


@pytest.mark.parametrize("mode", ["low_latency", pytest.param("max_throughput", marks=pytest.mark.slow)])
def test_mesh_sharded_by_the_engine_rules(mode, small_checkpoint, module):
    sharded = GptOss.from_pretrained(small_checkpoint, dtype="float32", mesh=make_mesh(2), mode=mode, progress=False)
    p = sharded.to_params()
    want = sharded.layout.param_shardings(sharded.config.num_kv_heads, p)
    assert all(a.sharding == s for a, s in zip(jax.tree.leaves(p), jax.tree.leaves(want)))
    tokens = jnp.asarray([_ids(T, seed=6)])  # one row: under max_throughput it is padded to the 2 ranks
    np.testing.assert_allclose(sharded(tokens), module(tokens), rtol=1e-5, atol=1e-5)


def test_from_pretrained_errors(tmp_path, small_checkpoint):
    with pytest.raises(ValueError, match="dtype='float16'"):
        GptOss.from_pretrained(small_checkpoint, dtype="float16")
    with pytest.raises(checkpoint.CheckpointError, match="checkpoint folder not found"):
        GptOss.from_pretrained(tmp_path / "nowhere", progress=False)


def test_call_refuses_bad_inputs(module):
    with pytest.raises(ValueError, match="token id 512 is outside the vocabulary"):
        module(jnp.asarray([1, 512]))
    with pytest.raises(ValueError, match=r"positions must lie in \[-1, 2\)"):
        module(jnp.asarray([1, 2]), jnp.asarray([0, 5]))
    with pytest.raises(ValueError, match="expected the token ids' shape"):
        module(jnp.asarray([[1, 2]]), jnp.asarray([0, 1, 2]))
    with pytest.raises(ValueError, match="expected"):
        module(jnp.zeros((0,), jnp.int32))
