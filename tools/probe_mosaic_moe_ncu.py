"""One Mosaic GPU MoE call (`moe_mosaic.experts`) on a model's expert shapes, for Nsight Compute to profile.

    XLA_FLAGS=--xla_gpu_enable_command_buffer= ncu --clock-control none -k regex:gate_up_body -c 1 --set full \
        -o gate_up python -m tools.probe_mosaic_moe_ncu --model 120b --tokens 1024

XLA's command buffers (CUDA graphs) are turned off so that ncu sees the kernel launches; the call runs once."""

import argparse

import jax
import jax.numpy as jnp

from pallas_kernels import expert_format, moe_mosaic, moe_reference
from tools import kernel_cases as kc


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="120b", choices=sorted(kc.SHAPES))
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--block-m", type=int, default=32, help="slot rows (the engine takes 32 past 8 rows an expert)")
    args = ap.parse_args()
    s = kc.SHAPES[args.model]
    k1, k2 = jax.random.split(jax.random.key(0))
    kx = jax.jit(expert_format.prepare_experts)(kc.experts(k1, s["E"], s["D"], s["I"]))
    x, rw, rb = kc.router(k2, s["E"], s["D"], args.tokens)
    idx, w, _ = moe_reference.route(x, rw, rb, s["k"])
    out = moe_mosaic.experts(
        x, idx, w, kx, swiglu_limit=kc.LIMIT, swiglu_alpha=kc.ALPHA, block_m=args.block_m, stages=2
    )
    print(f"{args.model} x {args.tokens} tokens: mean |out| {float(jnp.abs(out).mean()):.3g}", flush=True)


if __name__ == "__main__":
    main()
