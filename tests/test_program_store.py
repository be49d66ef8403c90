"""The program store (`gptoss_jax.program_store`): keys that follow what decides a program, entries that load and
run, stale or broken entries that compile instead, and a bounded folder."""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from gptoss_jax import program_store
from gptoss_jax.program_store import ProgramStore

DEVICES = jax.devices()[:1]


def _lowered(n=8, scale=2.0):
    return jax.jit(lambda x: x * scale + jnp.arange(x.shape[0], dtype=x.dtype)).lower(jnp.ones(n))


def test_keys_follow_static_settings_and_argument_shapes(tmp_path):
    store = ProgramStore(tmp_path)
    x, y = jnp.ones(8), jnp.ones(9)
    k = store.key("decode", ("st", 1), (x,))
    assert k == store.key("decode", ("st", 1), (jnp.zeros(8),))  # values do not matter
    assert (
        len(
            {
                k,
                store.key("decode", ("st", 2), (x,)),
                store.key("prefill", ("st", 1), (x,)),
                store.key("decode", ("st", 1), (y,)),
                store.key("decode", ("st", 1), (x.astype(jnp.int32),)),
                store.key("decode", ("st", 1), (jax.device_put(x, jax.devices()[0]),)),
            }
        )
        == 6
    )  # committed differs
    assert ProgramStore(None).key("decode", 1, (x,)) is None


def test_entries_load_and_run_broken_ones_compile_instead(tmp_path, caplog):
    store = ProgramStore(tmp_path)
    x = jnp.arange(8.0)
    compiled = store.compile(_lowered(), "k1")  # a fresh compilation is stored
    loaded = store.load("k1", DEVICES)
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(compiled(x)))
    assert store.load("missing", DEVICES) is None
    (tmp_path / "programs" / "k1.pkl").write_bytes(b"not a program")
    with caplog.at_level("WARNING", logger="gptoss_jax.program_store"):
        assert store.load("k1", DEVICES) is None
    assert "could not be loaded" in caplog.text


def test_the_folder_stays_bounded(tmp_path, monkeypatch):
    """Past `STORE_BYTES` the least recently used entries go (a load counts as a use)."""
    store = ProgramStore(tmp_path)
    for i, key in enumerate(("a", "b", "c")):
        store.save(key, _lowered(8 + i).compile())
        os.utime(tmp_path / "programs" / f"{key}.pkl", (time.time() - 100 + i, time.time() - 100 + i))
    store.load("a", DEVICES)  # now the most recently used; b is the least
    ProgramStore(tmp_path / "other").save("d", _lowered(20).compile())
    total = sum(p.stat().st_size for p in (tmp_path / "programs").glob("*.pkl"))
    total += (tmp_path / "other" / "programs" / "d.pkl").stat().st_size
    monkeypatch.setattr(program_store, "STORE_BYTES", total - 1)  # one entry too many
    store.save("d", _lowered(20).compile())
    assert sorted(p.stem for p in (tmp_path / "programs").glob("*.pkl")) == ["a", "c", "d"]
