"""EAGLE-3 drafters (gptoss_jax/eagle3.py): config and loader of the published layout, the forward against a numpy
implementation written from the published description (vLLM's llama_eagle3 and TensorRT-LLM's Eagle3 draft model,
docs/speculative.md), the draft loop, and the target's aux hidden states (`model.forward(..., aux_layers=...)`)."""

import copy
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gptoss_jax import checkpoint, config, eagle3, model, random_weights, safetensors_io
from gptoss_jax.checkpoint import CheckpointError
from gptoss_jax.config import ConfigError

REPO = Path(__file__).resolve().parent.parent
TARGET_HF = json.loads((REPO / "tests" / "tiny_config.json").read_text())
TARGET = config.from_hf_dict(TARGET_HF)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    return random_weights.write_eagle3_drafter(
        tmp_path_factory.mktemp("eagle3"), random_weights.eagle3_config(TARGET_HF), TARGET_HF, seed=3
    )


@pytest.fixture(scope="module")
def drafter(drafter_dir):
    return eagle3.load(drafter_dir, TARGET, jnp.float32)


def _files(path):
    reader = safetensors_io.Reader(path / "model.safetensors")
    return {n: np.asarray(reader.get(n)) for n in reader.names()}


def _rewrite(src, dst, tensors: dict, hf: dict | None = None):
    """A copy of drafter `src` at `dst` with these tensors (and config)."""
    dst.mkdir(parents=True, exist_ok=True)
    specs = {n: (a.shape, a.dtype) for n, a in tensors.items()}
    safetensors_io.write(dst / "model.safetensors", tensors.items(), specs)
    hf = hf if hf is not None else json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(hf))
    return dst


# ---- config ------------------------------------------------------------------------------------------------------


def test_config_of_a_published_120b_drafter():
    """A config shaped like NVIDIA's gpt-oss-120b drafters: 2880 wide, 64 x 64 heads over 8 KV heads, a 17280 MLP,
    aux layers in eagle_config, flags there too, llama3 RoPE."""
    target = config.preset("gpt-oss-120b")
    raw = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": 2880,
        "intermediate_size": 17280,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_hidden_layers": 1,
        "vocab_size": 201088,
        "draft_vocab_size": 32000,
        "rms_norm_eps": 1e-05,
        "rope_theta": 150000,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192},
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 17, 32], "norm_before_fc": True},
    }
    cfg = eagle3.from_hf_dict(raw, target)
    assert (cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size) == (2880, 2880, 17280)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 8, 64)
    assert (cfg.vocab_size, cfg.draft_vocab_size, cfg.aux_layer_ids) == (201088, 32000, (1, 17, 32))
    assert cfg.norm_before_fc and not cfg.norm_output and cfg.rope_type == "llama3" and cfg.rope_factor == 8.0
    specs = eagle3.tensor_specs(cfg)
    assert specs["fc.weight"][1] == (2880, 3 * 2880) and specs["input_norm.weight"][1] == (3 * 2880,)
    assert specs["midlayer.self_attn.q_proj.weight"][1] == (4096, 5760)
    assert specs["midlayer.self_attn.k_proj.weight"][1] == (512, 5760)
    assert specs["lm_head.weight"][1] == (32000, 2880)
    # without aux ids: vLLM's default for gpt-oss (the stream entering layers 2, L/2 and L-3)
    del raw["eagle_config"]
    assert eagle3.from_hf_dict(raw, target).aux_layer_ids == (2, 18, 33)
    assert eagle3.from_hf_dict(raw, config.preset("gpt-oss-20b")).aux_layer_ids == (2, 12, 21)


def test_llama3_rope_frequencies():
    """Hugging Face's llama3 rule: long wavelengths divided by the factor, short ones kept, a blend between."""
    cfg = eagle3.Eagle3Config(64, 64, 64, 4, 2, 128, 512, 128, (0,), rope_type="llama3", rope_theta=500000.0)
    cfg = eagle3.Eagle3Config(**{**cfg.__dict__, "rope_factor": 8.0})
    base = 1.0 / 500000.0 ** (np.arange(64) * 2 / 128)
    wavelen = 2 * np.pi / base
    got = eagle3.inv_freq(cfg)
    np.testing.assert_allclose(got[wavelen < 8192 / 4], base[wavelen < 8192 / 4])
    np.testing.assert_allclose(got[wavelen > 8192], base[wavelen > 8192] / 8)
    mid = (wavelen >= 8192 / 4) & (wavelen <= 8192)
    assert mid.any() and np.all((got[mid] <= base[mid]) & (got[mid] >= base[mid] / 8))


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda r: r.update(architectures=["LlamaForCausalLM"]), "'architectures'"),
        (lambda r: r.update(architectures=["Eagle3Speculator"]), "speculators"),
        (lambda r: r.update(hidden_size=128), "'hidden_size' is 128, but the target's hidden_size is 64"),
        (lambda r: r.update(target_hidden_size=96), "'target_hidden_size' is 96"),
        (lambda r: r.update(vocab_size=1000), "'vocab_size' is 1000"),
        (lambda r: r.pop("intermediate_size"), "missing required field 'intermediate_size'"),
        (lambda r: r.update(num_hidden_layers=2), "one-layer"),
        (lambda r: r.update(draft_vocab_size=0), "'draft_vocab_size'"),
        (lambda r: r.update(hidden_size="64"), "'hidden_size' must be int"),
        (lambda r: r["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 1, 3]), "0..2"),
        (lambda r: r["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 1]), "distinct"),
        (lambda r: r["eagle_config"].update(use_aux_hidden_state=False), "EAGLE-1"),
        (lambda r: r.update(fc_norm=True), "'fc_norm'"),
        (lambda r: r.update(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "'dynamic'"),
        (lambda r: r.update(rope_scaling={"rope_type": "llama3"}), "missing required field 'factor'"),
        (lambda r: r.update(tie_word_embeddings=True), "'tie_word_embeddings'"),
        (lambda r: r.update(num_key_value_heads=3), "multiple of num_key_value_heads=3"),
        (lambda r: r.pop("eagle_config"), r"absent and vLLM's default \[2, 1, -1\] does not fit"),
        (lambda r: r.update(rope_theta="big"), "'rope_theta' must be float"),
    ],
)
def test_config_errors_name_file_and_field(tmp_path, change, match):
    raw = copy.deepcopy(random_weights.eagle3_config(TARGET_HF))
    change(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=match) as e:
        eagle3.load_config(tmp_path, TARGET)
    assert str(tmp_path / "config.json") in str(e.value)


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        eagle3.load_config(tmp_path, TARGET)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="invalid JSON"):
        eagle3.load_config(tmp_path, TARGET)


# ---- loading -----------------------------------------------------------------------------------------------------


def test_loader_round_trip(drafter_dir, drafter):
    cfg, p = drafter
    files = _files(drafter_dir)
    for name, (field, shape) in eagle3.tensor_specs(cfg).items():
        if field and field != "d2t":
            got = np.asarray(getattr(p, field))
            assert got.shape == shape and got.dtype == np.float32
            np.testing.assert_array_equal(got, files[name].astype(np.float32))
    # d2t: offsets to the target ids that t2d marks, in order
    np.testing.assert_array_equal(
        np.asarray(eagle3.to_target(p, jnp.arange(cfg.draft_vocab_size))), np.flatnonzero(files["t2d"])
    )
    assert p.q_b is None and p.input_norm is None


def test_loader_reads_other_spellings_and_shares_the_target_embedding(drafter_dir, drafter, tmp_path):
    """`model.` prefixes and `layers.0.` for `midlayer.` load the same weights; without `embed_tokens` the
    drafter takes the target's embedding (the same array, not a copy) and errors without one."""
    files = _files(drafter_dir)
    embed = files.pop("embed_tokens.weight")
    renamed = {
        "model." + n.replace("midlayer.", "layers.0.") if n != "lm_head.weight" else n: a for n, a in files.items()
    }
    path = _rewrite(drafter_dir, tmp_path / "renamed", renamed)
    with pytest.raises(CheckpointError, match="shares the target's embedding"):
        eagle3.load(path, TARGET, jnp.float32)
    target_embed = jnp.asarray(embed, jnp.float32)
    cfg, p = eagle3.load(path, TARGET, jnp.float32, target_embed=target_embed)
    assert p.embed is target_embed
    _, ref = drafter
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(CheckpointError, match=r"does not fit the drafter's \[512, 64\]"):
        eagle3.load(path, TARGET, jnp.float32, target_embed=target_embed[:, :32])


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda f: f.pop("midlayer.mlp.up_proj.weight"),
            r"missing 1 tensor\(s\): \['midlayer.mlp.up_proj.weight \[384, 64\]'\]",
        ),
        (
            lambda f: f.update({"fc.weight": np.zeros((64, 128), f["fc.weight"].dtype)}),
            r"tensor 'fc.weight' has shape \[64, 128\], expected \[64, 192\]",
        ),
        (lambda f: f.update({"midlayer.extra.weight": np.zeros(3, np.float32)}), r"midlayer.extra.weight \[3\]"),
        (lambda f: f.pop("d2t"), r"'d2t \[128\]'"),
        (lambda f: f.update(d2t=np.full(128, 500, np.int64)), "'d2t' maps draft ids"),
        (lambda f: f.update(d2t=f["d2t"].astype(np.float32)), "'d2t' has dtype F32"),
    ],
)
def test_loader_errors_name_the_tensor(drafter_dir, tmp_path, edit, match):
    files = _files(drafter_dir)
    edit(files)
    path = _rewrite(drafter_dir, tmp_path / "bad", files)
    with pytest.raises(CheckpointError, match=match):
        eagle3.load(path, TARGET, jnp.float32)


def test_loader_resolves_like_the_target(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint folder not found"):
        eagle3.load(tmp_path / "nowhere", TARGET)


# ---- forward: an independent numpy implementation ------------------------------------------------------------------


def _np_params(drafter_dir):
    f = {n: a.astype(np.float64) for n, a in _files(drafter_dir).items() if n not in ("d2t", "t2d")}
    return f, _files(drafter_dir)["d2t"]


def _rms(x, g, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * g


def _ref_layer(f, cfg, tokens, hidden, positions, window):
    """The EAGLE-3 layer over one sequence's rows, recomputed from scratch: embedding and fused hidden state each
    normed, concatenated into q/k/v, causal GQA attention with half-split RoPE over the rows within `window`
    positions, residual from the hidden state, post-attention norm, SiLU-gated MLP, residual, final norm and
    lm_head. Returns (logits, pre-norm output)."""
    eps, N, K, hd = cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    e = _rms(f["embed_tokens.weight"][tokens], f["midlayer.input_layernorm.weight"], eps)
    x = np.concatenate([e, _rms(hidden, f["midlayer.hidden_norm.weight"], eps)], -1)
    T = len(tokens)
    q = (x @ f["midlayer.self_attn.q_proj.weight"].T).reshape(T, N, hd)
    k = (x @ f["midlayer.self_attn.k_proj.weight"].T).reshape(T, K, hd)
    v = (x @ f["midlayer.self_attn.v_proj.weight"].T).reshape(T, K, hd)
    ang = positions[:, None] * (1.0 / cfg.rope_theta ** (np.arange(hd // 2) * 2 / hd))
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]

    def rot(a):
        a1, a2 = a[..., : hd // 2], a[..., hd // 2 :]
        return np.concatenate([a1 * cos - a2 * sin, a2 * cos + a1 * sin], -1)

    q, k = rot(q), rot(k)
    o = np.zeros((T, N, hd))
    for i in range(T):
        seen = [j for j in range(T) if positions[i] - window < positions[j] <= positions[i]]
        for n in range(N):
            s = np.array([q[i, n] @ k[j, n // (N // K)] for j in seen]) / np.sqrt(hd)
            w = np.exp(s - s.max())
            o[i, n] = (w / w.sum()) @ v[seen, n // (N // K)]
    h1 = o.reshape(T, N * hd) @ f["midlayer.self_attn.o_proj.weight"].T + hidden
    m = _rms(h1, f["midlayer.post_attention_layernorm.weight"], eps)
    g = m @ f["midlayer.mlp.gate_proj.weight"].T
    h2 = ((g / (1 + np.exp(-g))) * (m @ f["midlayer.mlp.up_proj.weight"].T)) @ f["midlayer.mlp.down_proj.weight"].T + h1
    return _rms(h2, f["norm.weight"], eps) @ f["lm_head.weight"].T, h2


def _aux(seed, T, A=3, D=64):
    return np.random.default_rng(seed).standard_normal((A, T, D))


def _pages(tables, cached=None):
    t = jnp.asarray(tables, jnp.int32)
    return eagle3.Pages(t, jnp.zeros(t.shape[0], jnp.int32) if cached is None else jnp.asarray(cached, jnp.int32))


def _keys(B, seed=0):
    return jnp.stack([jnp.full(B, seed, jnp.uint32), jnp.arange(B, dtype=jnp.uint32)], 1)


def test_step_matches_reference_across_calls(drafter_dir, drafter):
    """Nine rows fed as 5 + 3 + 1 rows in three calls through the drafter's paged K/V (padding rows included) equal
    the reference over all nine at once; only the sequence's pages are written, prefix-cached positions never."""
    cfg, p = drafter
    f, _ = _np_params(drafter_dir)
    T = 9
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 512, T)
    aux = _aux(1, T)
    hidden = np.concatenate(list(aux), -1) @ f["fc.weight"].T  # fc over the aux states in id order
    ref_logits, ref_h = _ref_layer(f, cfg, tokens, hidden, np.arange(T, dtype=np.float64), 1 << 20)

    run = jax.jit(eagle3.step, static_argnames=("cfg", "write"))
    kv = eagle3.DraftKV.zeros(cfg, 8, 4, jnp.float32)  # 4-position pages; row 1 holds pages 5, 2, 7
    pages = _pages([[0, 0, 0], [5, 2, 7]])
    logits, hs = [], []
    for lo, hi, width in ((0, 5, 5), (5, 8, 4), (8, 9, 1)):  # the middle call has one padding row
        n = hi - lo
        tok = np.zeros((2, width), np.int32)
        pos = np.full((2, width), -1, np.int32)
        tok[1, :n], pos[1, :n] = tokens[lo:hi], np.arange(lo, hi)
        h = np.zeros((2, width, 64), np.float32)
        h[1, :n] = np.asarray(eagle3.fuse(p, cfg, jnp.asarray(aux[:, None, lo:hi], jnp.float32)))[0]
        out = run(p, cfg, kv, jnp.asarray(tok), jnp.asarray(h), jnp.asarray(pos), pages)
        kv = out.kv
        logits.append(np.asarray(out.logits[1, :n]))
        hs.append(np.asarray(out.hidden[1, :n]))
    np.testing.assert_allclose(np.concatenate(logits), ref_logits, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.concatenate(hs), ref_h, rtol=2e-4, atol=2e-4)
    written = np.abs(np.asarray(kv.k)).sum((2, 3)) > 0  # [page, slot]
    want = np.zeros((8, 4), bool)
    want[5], want[2], want[7, 0] = True, True, True  # positions 0-3, 4-7, 8
    np.testing.assert_array_equal(written, want)
    # a prefix-cached sequence (positions below 8 in shared pages) writes only position 8 on
    again = run(
        p,
        cfg,
        eagle3.DraftKV.zeros(cfg, 8, 4, jnp.float32),
        jnp.asarray(tokens[None]),
        jnp.asarray(hidden[None], jnp.float32),
        jnp.arange(T, dtype=jnp.int32)[None],
        _pages([[5, 2, 7]], [8]),
    )
    assert (np.abs(np.asarray(again.kv.k)).sum((2, 3)) > 0).nonzero() == (np.array([7]), np.array([0]))


def test_propose_greedy_matches_reference_loop(drafter_dir, drafter):
    """Greedy drafts: the first from the last verified row, each next one from the drafter's own pre-norm output
    and drafted token one position on (EAGLE-3's loop), mapped through d2t; the reference recomputes every row.
    Sampled drafts: each step's distribution is the reference's over the drafts drawn before it."""
    cfg, p = drafter
    f, d2t = _np_params(drafter_dir)
    k, T = 4, 6
    rng = np.random.default_rng(2)
    tokens, aux = rng.integers(0, 512, T), _aux(3, T)
    hidden = np.concatenate(list(aux), -1) @ f["fc.weight"].T
    rows_tok, rows_h, rows_pos = list(tokens), list(hidden), list(range(T))
    want = []
    for _ in range(k):
        logits, h2 = _ref_layer(f, cfg, np.array(rows_tok), np.array(rows_h), np.array(rows_pos, float), 1 << 20)
        d = int(np.argmax(logits[-1]))
        want.append(d + int(d2t[d]))
        rows_tok.append(want[-1])
        rows_h.append(h2[-1])
        rows_pos.append(rows_pos[-1] + 1)

    propose = jax.jit(eagle3.propose, static_argnames=("cfg", "num_tokens"))
    kv = eagle3.DraftKV.zeros(cfg, 8, 4, jnp.float32)
    args = (
        jnp.asarray(tokens[None], jnp.int32),
        jnp.asarray(aux[:, None], jnp.float32),
        jnp.arange(T, dtype=jnp.int32)[None],
        _pages([[1, 2, 3, 4, 5, 6]]),
        jnp.zeros((1,), jnp.float32),
        _keys(1),
    )
    out = propose(p, cfg, kv, *args, num_tokens=k)
    assert out.tokens.shape == (1, k) and out.draft_ids.shape == (1, k) and out.probs.shape == (1, k, 128)
    assert np.asarray(out.tokens[0]).tolist() == want
    np.testing.assert_array_equal(np.asarray(out.probs[0]), np.eye(128)[np.asarray(out.draft_ids[0])])
    # sampled: each step's distribution is softmax(logits) of the reference fed the drafts actually drawn
    out_s = propose(p, cfg, kv, *args[:4], jnp.ones((1,), jnp.float32), _keys(1, 3), num_tokens=k)
    drawn = np.asarray(out_s.tokens[0]).tolist()
    fed = []  # the hidden states the draft steps fed back
    for j in range(k):
        rows = list(tokens) + drawn[:j]
        logits, h2 = _ref_layer(
            f, cfg, np.array(rows), np.array(list(hidden) + fed), np.arange(len(rows), dtype=float), 1 << 20
        )
        fed.append(h2[-1])
        e = np.exp(logits[-1] - logits[-1].max())
        np.testing.assert_allclose(np.asarray(out_s.probs[0, j]), e / e.sum(), rtol=1e-4, atol=1e-6)
    # the pool holds the verified rows (positions 0-5: pages 1 and 2) only; the drafted ones stayed in the call
    written = np.abs(np.asarray(out.kv.k)).sum((2, 3)) > 0
    assert [4 * (page - 1) + slot for page, slot in zip(*written.nonzero())] == list(range(T))


def test_propose_sampling_is_seeded_and_batched(drafter):
    """Sampled rows draw from the distribution they report, the same key draws the same tokens, and rows of one
    batch (different lengths, one all padding) do not affect each other."""
    cfg, p = drafter
    B, T, k = 3, 4, 3
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, 512, (B, T)), jnp.int32)
    aux = jnp.asarray(rng.standard_normal((3, B, T, 64)), jnp.float32)
    pos = jnp.asarray([[0, 1, 2, 3], [0, 1, -1, -1], [-1, -1, -1, -1]], jnp.int32)
    pages, temp = _pages([[1, 2], [3, 4], [5, 6]]), jnp.asarray([1.0, 0.7, 1.0], jnp.float32)
    propose = jax.jit(eagle3.propose, static_argnames=("cfg", "num_tokens"))
    kv = eagle3.DraftKV.zeros(cfg, 7, 4, jnp.float32)
    a = propose(p, cfg, kv, tokens, aux, pos, pages, temp, _keys(B, 7), num_tokens=k)
    b = propose(p, cfg, kv, tokens, aux, pos, pages, temp, _keys(B, 7), num_tokens=k)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    probs, ids = np.asarray(a.probs), np.asarray(a.draft_ids)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    assert np.all(np.take_along_axis(probs, ids[..., None], -1) > 0)
    assert not np.any(np.asarray(a.kv.k)[5:])  # the padding row wrote nothing
    # row 1 alone gives the same draws for the same key material
    alone = propose(p, cfg, kv, tokens, aux, pos.at[0].set(-1), pages, temp, _keys(B, 7), num_tokens=k)
    np.testing.assert_allclose(np.asarray(alone.probs[1]), probs[1], rtol=1e-5, atol=1e-7)
    # the target-vocabulary view puts each probability at its target id
    full = np.asarray(eagle3.to_target_vocab(p, a.probs, cfg.vocab_size))
    assert full.shape == (B, k, 512)
    np.testing.assert_allclose(
        np.take_along_axis(full, np.asarray(a.tokens)[..., None], -1)[..., 0],
        np.take_along_axis(probs, ids[..., None], -1)[..., 0],
    )
    np.testing.assert_allclose(full.sum(-1), 1.0, rtol=1e-5)


# ---- the target's aux hidden states --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target_params(small_checkpoint):
    return checkpoint.load_params(small_checkpoint, jnp.float32, progress=False)


def _target_args(loaded, T=12):
    cfg, params = loaded
    cache = model.PagedKVCache.zeros(cfg, 9, 9, 4, jnp.float32)
    table = jnp.arange(1, 5, dtype=jnp.int32)[None]
    tables = model.PageTables(table, table, jnp.zeros((1,), jnp.int32))
    ids = jnp.asarray(np.random.default_rng(0).integers(2, 512, (1, T)), jnp.int32)
    return cfg, (params, cache, ids, jnp.arange(T, dtype=jnp.int32)[None], tables)


def test_aux_hidden_states_are_the_layer_inputs(target_params):
    """`aux_layers=(i, ...)` returns the residual stream entering layer i: the embeddings for 0, layer i-1's
    output (as the inspection records it) otherwise, in the order asked; the rest of the forward is unchanged."""
    cfg, args = _target_args(target_params)
    plain = jax.jit(lambda *a: model.forward(*a, cfg=cfg, inspect=model.Inspect(hidden_states=True)))(*args)
    t, _, _, aux = jax.jit(lambda *a: model.forward(*a, cfg=cfg, aux_layers=(2, 0, 1)))(*args)
    layers = np.asarray(plain[2].hidden_states)  # [L, B, T, D] after each layer
    np.testing.assert_array_equal(np.asarray(t), np.asarray(plain[0]))
    assert aux.shape == (3, 1, 12, 64) and aux.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(aux[1]), np.asarray(args[0].embed[args[2]]), rtol=0, atol=0)
    np.testing.assert_allclose(np.asarray(aux[2]), layers[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(aux[0]), layers[1], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"must lie in 0..2"):
        model.forward(*args, cfg=cfg, aux_layers=(3,))


def test_aux_off_is_the_plain_program(target_params):
    """Off (the default) the forward returns its three outputs and adds no operation; on, it adds no arithmetic
    (only the in-place writes)."""
    cfg, args = _target_args(target_params)
    off = jax.jit(lambda *a: model.forward(*a, cfg=cfg))
    on = jax.jit(lambda *a: model.forward(*a, cfg=cfg, aux_layers=(0, 1, 2))[:3])
    assert len(jax.eval_shape(off, *args)) == 3
    assert str(jax.make_jaxpr(lambda *a: model.forward(*a, cfg=cfg))(*args)) == str(
        jax.make_jaxpr(lambda *a: model.forward(*a, cfg=cfg, aux_layers=()))(*args)
    )
    assert "dynamic_update_slice" not in str(jax.make_jaxpr(lambda *a: model.forward(*a, cfg=cfg))(*args))

    def flops(f):
        c = f.lower(*args).compile().cost_analysis()
        return (c[0] if isinstance(c, list) else c)["flops"]

    assert flops(off) == flops(on)


def test_drafter_runs_on_the_targets_aux_states(target_params, drafter):
    """End to end on the tiny target: its aux states at the drafter's layer ids feed `propose`."""
    dcfg, p = drafter
    cfg, args = _target_args(target_params, T=8)
    _, _, _, aux = jax.jit(lambda *a: model.forward(*a, cfg=cfg, aux_layers=dcfg.aux_layer_ids))(*args)
    tokens = jnp.concatenate([args[2][:, 1:], jnp.asarray([[7]], jnp.int32)], 1)  # the next token of each row
    kv = eagle3.DraftKV.zeros(dcfg, 5, 4, jnp.float32)
    propose = jax.jit(eagle3.propose, static_argnames=("cfg", "num_tokens"))
    out = propose(p, dcfg, kv, tokens, aux, args[3], _pages([[1, 2, 3, 4]]), jnp.zeros(1), _keys(1), num_tokens=3)
    assert out.tokens.shape == (1, 3) and np.all((np.asarray(out.tokens) >= 0) & (np.asarray(out.tokens) < 512))


def test_make_checkpoint_writes_a_drafter(tmp_path):
    """`tools.make_checkpoint --eagle3` writes a drafter the loader reads, here without an embedding of its own."""
    from tools import make_checkpoint

    out = tmp_path / "drafter"
    make_checkpoint.main(
        ["--config", str(REPO / "tests" / "tiny_config.json"), "--eagle3", "--out", str(out)]
        + ["--draft-vocab-size", "64", "--no-embed"]
    )
    names = set(safetensors_io.Reader(out / "model.safetensors").names())
    assert "embed_tokens.weight" not in names and {"fc.weight", "d2t", "t2d", "lm_head.weight"} <= names
    cfg, p = eagle3.load(out, TARGET, jnp.float32, target_embed=jnp.zeros((512, 64), jnp.float32))
    assert cfg.draft_vocab_size == 64 and p.lm_head.shape == (64, 64)


def test_one_aux_state_drafter_without_fc(tmp_path):
    """A drafter of one aux state as wide as its target may ship no `fc` (TensorRT-LLM's layout): the aux state
    then is the hidden state; with two aux states `fc` stays required."""
    hf = random_weights.eagle3_config(TARGET_HF, eagle_config={"eagle_aux_hidden_state_layer_ids": [2]})
    src = random_weights.write_eagle3_drafter(tmp_path / "one", hf, TARGET_HF, seed=4)
    files = _files(src)
    files.pop("fc.weight")
    path = _rewrite(src, tmp_path / "nofc", files)
    cfg, p = eagle3.load(path, TARGET, jnp.float32)
    assert p.fc is None and cfg.aux_layer_ids == (2,)
    aux = jnp.asarray(_aux(6, 4, A=1)[:, None], jnp.float32)
    np.testing.assert_array_equal(np.asarray(eagle3.fuse(p, cfg, aux)), np.asarray(aux[0]))
    hf2 = random_weights.eagle3_config(TARGET_HF, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2]})
    _rewrite(src, tmp_path / "two", files, hf2)
    with pytest.raises(CheckpointError, match=r"fc.weight \[64, 128\]"):
        eagle3.load(tmp_path / "two", TARGET, jnp.float32)
