"""Does a compiled call return before its device work ends? Async dispatch is what lets the engine
build the next step while the GPU runs this one, and some programs silently lose it.

Each variant runs ~20 ms of bf16 matmuls and prints when the jit call returns and when its result is
ready; a return time close to the ready time means the call blocks the host. The variants: plain; a
`lax.cond` after the work, with cheap branches or with a branch holding `lax.top_k`, a sort or an
argmax (like the sampler's conditionals); a `lax.cond` around the work; a `lax.scan` (static trip
count, like the model's layers). Then two calls back to back, the second on the first's unfinished
(donated or kept) output, and a queue of eight. On an H200 with jax 0.11.2 none of these blocked,
although the engine's step did while its log-probability branch held `lax.top_k`
(docs/BENCHMARKS.md §4d): to check an engine change, use `bench_throughput.py`'s host split or
`profile_decode.py`'s return times. XLA flags are read at start-up, so compare them in separate runs:

    python tools/probe_dispatch.py
    XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL,CONDITIONAL,WHILE python tools/probe_dispatch.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def chain(x, n: int = 16):
    for _ in range(n):
        x = (x @ x) * 1e-4
    return x


VARIANTS = {
    "plain": lambda x, p: chain(x).sum() + p.sum(),
    "cond_after": lambda x, p: (lambda y: jax.lax.cond(jnp.any(p > 0), lambda: y.sum(), lambda: y.max()))(chain(x)),
    "cond_around": lambda x, p: jax.lax.cond(jnp.any(p > 0), lambda: chain(x).sum(), lambda: chain(x).max()),
    "cond_top_k": lambda x, p: (lambda y: jax.lax.cond(jnp.any(p > 0), lambda: jax.lax.top_k(y, 20)[0].sum(),
                                                       lambda: y.max()))(chain(x)),
    "cond_sort": lambda x, p: (lambda y: jax.lax.cond(jnp.any(p > 0), lambda: jnp.sort(y[:, :32], axis=-1).sum(),
                                                      lambda: y.max()))(chain(x)),
    "cond_argmax": lambda x, p: (lambda y: jax.lax.cond(jnp.any(p > 0), lambda: jnp.argmax(y, axis=-1).sum(),
                                                        lambda: y.max().astype(jnp.int32)))(chain(x)),
    "scan": lambda x, p: jax.lax.scan(lambda c, _: (chain(c, 1), None), x, None, length=16)[0].sum() + p.sum(),
}


def main() -> None:
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    x = jax.random.normal(jax.random.PRNGKey(0), (size, size), jnp.bfloat16)
    p = jnp.ones(4)
    out = {"device": jax.devices()[0].device_kind, "xla_flags": os.environ.get("XLA_FLAGS", ""), "variants": {}}
    for name, fn in VARIANTS.items():
        f = jax.jit(fn)
        f(x, p).block_until_ready()
        ret, ready = [], []
        for _ in range(7):
            t0 = time.perf_counter()
            y = f(x, p)
            ret.append(time.perf_counter() - t0)
            y.block_until_ready()
            ready.append(time.perf_counter() - t0)
        r, d = statistics.median(ret) * 1e3, statistics.median(ready) * 1e3
        out["variants"][name] = {"return_ms": r, "ready_ms": d}
        print(f"{name:12s} returns after {r:7.2f} ms, ready after {d:7.2f} ms", flush=True)
    # Back to back, as the engine dispatches: the second call's input is the first call's output, still
    # being computed (donated, as the engine donates its KV cache, or not), plus a fresh host array.
    for donate in (False, True):
        g = jax.jit(lambda x, p: chain(x) + p.sum(), donate_argnums=(0,) if donate else ())
        y = g(x.copy(), p).block_until_ready()
        ret = []
        for _ in range(7):
            y = g(y, p)
            t0 = time.perf_counter()
            y = g(y, jnp.asarray(np.ones(4, np.float32)))
            ret.append(time.perf_counter() - t0)
            y.block_until_ready()
        name = "chain_donated" if donate else "chain"
        out["variants"][name] = {"second_return_ms": statistics.median(ret) * 1e3}
        print(f"{name:14s} the second call returns after {statistics.median(ret) * 1e3:7.2f} ms", flush=True)
    # A queue of eight calls, each on the previous one's output: where does the host start waiting?
    g = jax.jit(lambda x: chain(x, 2), donate_argnums=(0,))
    y = g(x.copy()).block_until_ready()
    rets = []
    for _ in range(8):
        t0 = time.perf_counter()
        y = g(y)
        rets.append((time.perf_counter() - t0) * 1e3)
    y.block_until_ready()
    out["queue_return_ms"] = rets
    print("queue of 8 calls of ~3 ms, each returns after (ms):", " ".join(f"{r:.2f}" for r in rets), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
