"""A step's host arrays packed into one transfer and sliced back inside the compiled step (`gptoss_jax.upload`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gptoss_jax import upload


def _batch():
    rng = np.random.default_rng(0)
    return {
        "tokens": rng.integers(-5, 1 << 30, (3, 7)).astype(np.int32),
        "temperature": rng.standard_normal(3).astype(np.float32) * np.float32(1e30),  # bits, not values, travel
        "keys": rng.integers(0, 1 << 32, (3, 2), dtype=np.uint64).astype(np.uint32),
        "want": np.array([True, False, True]),
        "empty": np.zeros((0, 4), np.int32),
        "on_device": jnp.arange(5, dtype=jnp.int32),
        "scalar": np.array(np.float32(-0.0)),
    }


def test_a_packed_batch_comes_back_bit_identical_inside_a_compiled_step():
    batch = _batch()
    packed = upload.pack(batch)
    assert isinstance(packed.words, np.ndarray) and packed.words.dtype == np.int32
    assert packed.words.size == 21 + 3 + 6 + 3 + 0 + 1  # every host element, one word each
    assert len(packed.others) == 1  # the device array stays a leaf of its own
    moved = packed.__class__(jax.device_put(packed.words), packed.others, packed.layout)
    out = jax.jit(upload.unpack)(moved)
    for name, want in batch.items():
        got = np.asarray(out[name])
        assert got.dtype == np.asarray(want).dtype and got.shape == np.asarray(want).shape, name
        np.testing.assert_array_equal(
            got.reshape(-1).view(np.uint8), np.asarray(want).reshape(-1).view(np.uint8), err_msg=name
        )


def test_the_layout_is_static_so_equal_shapes_share_one_program():
    a, b = upload.pack(_batch()), upload.pack({**_batch(), "tokens": np.ones((3, 7), np.int32)})
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert jax.tree.structure(a) != jax.tree.structure(upload.pack({**_batch(), "tokens": np.ones((3, 8), np.int32)}))


def test_an_unpackable_dtype_is_named():
    with pytest.raises(TypeError, match="int64"):
        upload.pack({"x": np.zeros(2, np.int64)})


def test_anything_not_packed_passes_through_unpack():
    batch = _batch()
    assert upload.unpack(batch) is batch
