"""`pallas_kernels.ragged_dot`: the tiles cover every grouped row exactly once with its own group's weights (the
kernel's tile arithmetic, run here on plain arrays), and on a Hopper GPU the kernel equals `lax.ragged_dot`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ragged_dot
from pallas_kernels.choice import Device

SIZES = [
    (0, 300, 1, 0, 129, 7, 0, 40),
    (128, 128, 128),
    (0, 0, 0, 5),
    (0, 0, 0, 0),
    (1,) * 9,
    (1000, 3),
    (5, 127, 129, 7, 250),  # windows from unaligned starts
]


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("bm", [64, 128])
def test_tiles_cover_each_grouped_row_once_with_its_group(sizes, bm):
    """Every grouped row in exactly one tile of its own group, in `cdiv(start % 8 + size, bm)` tiles a group."""
    G, first = len(sizes), 24
    M = -(-(sum(sizes) + 3) // 8) * 8
    grid_m = -(-(M + 7 * G) // bm) + G - 1
    g = jnp.asarray(sizes, jnp.int32)
    table = jnp.concatenate(
        [ragged_dot.tile_starts(g, bm), (first + jnp.arange(G, dtype=jnp.int32))[None], g[None]]
    ).reshape(4 * G)
    owner, busy = np.full(M, -1), 0
    for tile in range(grid_m):
        w_index, window8, row0, rows = (int(v) for v in ragged_dot._locate(table, G, jnp.int32(tile), bm, M))
        window = 8 * window8
        if rows == 0:  # past the groups' tiles
            continue
        assert 0 <= row0 and row0 + rows <= bm and 0 <= window and (window + bm <= M or window == 0)
        busy += 1
        for r in range(window + row0, window + row0 + rows):
            assert owner[r] == -1, f"row {r} written twice"
            owner[r] = w_index
    starts = np.cumsum(sizes) - sizes  # each group's own tiles, from its first row rounded down to 8s:
    assert busy == sum(-(-(s % 8 + n) // bm) for s, n in zip(starts, sizes) if n)  # none for a neighbour's rows
    want = np.concatenate([np.full(n, first + i) for i, n in enumerate(sizes)] + [np.full(M - sum(sizes), -1)])
    np.testing.assert_array_equal(owner, want)


def test_a_stack_that_does_not_tile_is_refused():
    x, w = jnp.zeros((16, 96), jnp.bfloat16), jnp.zeros((4, 128, 96), jnp.bfloat16)
    with pytest.raises(ValueError, match="block_k=64"):
        ragged_dot.ragged_dot(x, w, 0, jnp.ones((2,), jnp.int32))


@pytest.mark.skipif(not Device.current().hopper, reason="Mosaic GPU kernel: Hopper only")
@pytest.mark.parametrize("sizes", SIZES[:3])
def test_the_kernel_equals_lax_ragged_dot(sizes):
    G, N, K = len(sizes), 384, 256
    M = -(-(sum(sizes) + 3) // 8) * 8
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(k1, (M, K), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(k2, (3 * G, N, K), jnp.float32).astype(jnp.bfloat16)
    g = jnp.asarray(sizes, jnp.int32)
    P = sum(sizes)
    got = jax.jit(ragged_dot.ragged_dot)(x, w, jnp.int32(G), g)[:P]
    want = ragged_dot.ragged_dot_reference(x, w, G, g)[:P]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-1)
