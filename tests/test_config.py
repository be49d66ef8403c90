import json

import pytest

from gptoss_jax import config
from gptoss_jax.config import ConfigError, from_hf_dict, load_config, preset


def _hf():
    return json.loads((config.PRESETS_DIR / "gpt-oss-20b.json").read_text())


def test_presets_match_published_shapes():
    c20, c120 = preset("gpt-oss-20b"), preset("gpt-oss-120b")
    assert (c20.num_layers, c20.num_experts, c120.num_layers, c120.num_experts) == (24, 32, 36, 128)
    assert round(c20.param_count / 1e9, 2) == 20.91 and round(c120.param_count / 1e9, 2) == 116.83
    assert c20.rope_factor == 32 and c20.rope_truncate is False and c20.sliding_window == 128
    assert c20.eos_token_ids == (200002, 200012)  # <|call|> added: config.json lists only <|return|>


def test_rope_parameters_layout_equals_rope_scaling_layout():
    old = _hf()
    new = {k: v for k, v in old.items() if k not in ("rope_scaling", "rope_theta")}
    new["rope_parameters"] = dict(old["rope_scaling"], rope_theta=old["rope_theta"])
    assert from_hf_dict(new) == from_hf_dict(old)


def test_original_config_equals_hf(tmp_path):
    from gptoss_jax.random_weights import to_original_config

    (tmp_path / "original").mkdir()
    (tmp_path / "original" / "config.json").write_text(json.dumps(to_original_config(_hf())))
    a, b = load_config(tmp_path), from_hf_dict(_hf())
    assert a.rope_beta_fast == 32 and a.rope_beta_slow == 1  # crossed ntk_alpha/ntk_beta naming
    assert {k: v for k, v in vars(a).items() if k != "pad_token_id"} == {
        k: v for k, v in vars(b).items() if k != "pad_token_id"
    }


def test_unknown_keys_tolerated():
    raw = _hf() | {"some_future_key": 1, "rope_scaling": dict(_hf()["rope_scaling"], extra=2)}
    assert from_hf_dict(raw).num_layers == 24


def test_missing_key_names_key_and_file(tmp_path):
    raw = _hf()
    del raw["num_local_experts"]
    f = tmp_path / "config.json"
    f.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"config.json: missing required key 'num_local_experts'"):
        load_config(tmp_path)
    raw = _hf()
    del raw["rope_theta"]
    with pytest.raises(ConfigError, match="rope_theta"):
        from_hf_dict(raw)


def test_bad_files_and_values(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="invalid JSON"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="multiple of num_key_value_heads"):
        from_hf_dict(_hf() | {"num_key_value_heads": 7})
    with pytest.raises(ConfigError, match="layer_types"):
        from_hf_dict(_hf() | {"layer_types": ["full_attention", "sliding_attention"] * 12})
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("gpt-oss-7b")


def test_layer_parity_layer0_sliding():
    c = preset("gpt-oss-20b")
    assert [c.is_sliding(i) for i in range(4)] == [True, False, True, False]


@pytest.mark.parametrize("preset_env, expected", [(None, "0.92"), ("0.5", "0.5")])
def test_gpu_memory_fraction_default(preset_env, expected):
    """Importing changes no process setting; `runtime.prepare()` (what `Engine`, `LLM` and `serve` call before they
    touch a device) raises JAX's GPU pool from 75% to 92% unless the user chose a value."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}
    if preset_env is not None:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = preset_env
    code = (
        "import os, gptoss_jax, gptoss_jax.llm, pallas_kernels, sharding.rules; "
        "print(os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION')); "
        "from gptoss_jax import runtime; runtime.prepare(); print(os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'])"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(preset_env), expected]


@pytest.mark.parametrize("package", ["pallas_kernels", "sharding", "sharding.rules", "gptoss_jax"])
def test_lower_layers_load_no_engine(package):
    """Imports point down (gptoss_jax -> sharding -> pallas_kernels): importing a lower layer, or the package's
    lazy top, loads none of the serving modules."""
    import subprocess
    import sys

    code = (
        f"import sys, {package}; "
        "print(sorted(m for m in sys.modules if m.startswith(('gptoss_jax.', 'sharding', 'pallas_kernels'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = eval(out.stdout)
    assert not [m for m in loaded if m.startswith("gptoss_jax.")], loaded
    if package.startswith("pallas_kernels"):
        assert not [m for m in loaded if m.startswith("sharding")], loaded


def test_null_eos_and_pad_token_ids_load():
    """Hugging Face allows `"eos_token_id": null` (and a null pad id): the harmony stops remain, nothing crashes."""
    c = from_hf_dict(_hf() | {"eos_token_id": None, "pad_token_id": None})
    assert c.eos_token_ids == (200002, 200012) and c.pad_token_id == 199999
    assert from_hf_dict(_hf() | {"eos_token_id": [200002, None]}).eos_token_ids == (200002, 200012)
    with pytest.raises(ConfigError, match=r"config.json: eos_token_id='x'"):
        from_hf_dict(_hf() | {"eos_token_id": "x"})
