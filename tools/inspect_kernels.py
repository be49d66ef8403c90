"""Registers, spills and waves of the decode step's Pallas-Triton kernels, on a machine without a GPU.

Lowers the compiled decode step (`steps.decode`, the engine's path) for CUDA at a preset's real shapes, on the
CPU, with abstract weights (nothing is allocated). Each Pallas-Triton kernel in it is compiled for sm_90a with
the `triton` wheel (`pip install -e '.[inspect]'`: its compiler and bundled CUDA tools; no GPU or driver) and
reported: grid, warps, pipeline stages, registers a thread, spill (local-memory) bytes, shared memory, the
programs one SM holds at once, and the waves its grid takes on the H200's 132 SMs:

    python -m tools.inspect_kernels --preset gpt-oss-20b --batch 1 --variant stages2:linear_stages=2
    python -m tools.inspect_kernels --batch 8 --prefill 2048 --context 6144   # a long prompt's prefill call

Each kernel's loops are listed by the instructions a warp issues per iteration (SASS from `cuobjdump -sass`):
the flash kernel's KV loops went from 857 to 362 that way before the H200 measured it 36% faster (docs/kernels.md).

Why: at batch 1 a kernel's registers decide how many of its programs are resident (session 14's ncu report: 64
registers, 128 threads, 8 programs an SM); a change that adds work to a kernel can push it into a second wave
or into spills, and that shows here before any GPU time is spent. It does not time anything.

The GPU machine compiles the same Triton IR with XLA's own Triton and CUDA 13's ptxas; the wheel's compiler
may allocate a few registers differently, so read the numbers as estimates of the same code, and compare
variants within one run. Mosaic GPU kernels (Hopper's batch >= 2 projections and mid-batch MoE) are not lowered
here: the kernel config is an H200's with `mosaic=false` (a variant's fields replace that base's), which matches
the GPU at batch 1.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import json
import math
import os
import re
import subprocess
import tempfile
from pathlib import Path

import jax
from jax._src.pallas.triton import gpu_info, pallas_call_registration

from pallas_kernels import KernelConfig
from pallas_kernels.choice import H200
from tools.common import decode_step, model_config, param_shapes, parse_variants, prefill_step

# Lowered for an H200 without the Mosaic GPU kernels (their lowering needs the GPU).
BASE = KernelConfig(impl="pallas", mosaic=False)

# H200 (sm_90) per-SM limits that bound how many programs are resident at once.
SMS, SM_REGS, SM_WARPS, SM_PROGRAMS, SM_SHARED, PROGRAM_SHARED_RESERVED = 132, 65536, 64, 32, 233472, 1024


def resident_programs(regs: int, warps: int, shared: int) -> int:
    """Programs of one kernel an SM holds: registers are allocated per warp in units of 256 (a thread's
    count rounded up to a multiple of 8), shared memory per program with 1 KB reserved."""
    per_warp = math.ceil(max(regs, 1) * 32 / 256) * 256
    return min(
        SM_REGS // (per_warp * warps), SM_WARPS // warps, SM_PROGRAMS, SM_SHARED // (shared + PROGRAM_SHARED_RESERVED)
    )


@contextlib.contextmanager
def lowering_for_hopper():
    """Trace and lower as on an H200 (jax's own functions, patched while the block runs): the kernels'
    `interpret` default asks `jax.default_backend()`; the Triton lowering asks for the device's compute
    capability. Which kernels run is the kernel config's (`for_device(H200)`)."""
    saved = (jax.default_backend, pallas_call_registration.gpu_info_lib.get_gpu_info)
    hopper = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    jax.default_backend = lambda: "gpu"
    pallas_call_registration.gpu_info_lib.get_gpu_info = lambda: hopper
    try:
        yield
    finally:
        jax.default_backend, pallas_call_registration.gpu_info_lib.get_gpu_info = saved


@contextlib.contextmanager
def capture_triton_modules(out: list[dict]):
    """Record every Pallas-Triton kernel lowered meanwhile: its Triton IR text, grid, warps and stages (read
    from the lowering rule's frame, which has them as locals at that point)."""
    lowering = pallas_call_registration.lowering
    original = lowering.lower_jaxpr_to_triton_module

    def spy(jaxpr, grid_mapping, *args, **kwargs):
        result = original(jaxpr, grid_mapping, *args, **kwargs)
        caller = inspect.currentframe().f_back.f_locals
        text = result.module.operation.get_asm(enable_debug_info=False, print_generic_op_form=True)
        out.append(
            dict(
                name=re.search(r'sym_name = "([^"]+)"', text).group(1),
                ir=text,
                grid=tuple(int(g) for g in grid_mapping.grid),
                num_warps=int(caller["num_warps"]),
                num_stages=int(caller["num_stages"]),
            )
        )
        return result

    lowering.lower_jaxpr_to_triton_module = spy
    try:
        yield
    finally:
        lowering.lower_jaxpr_to_triton_module = original


def step_kernels(
    preset: str, batch: int, context: int, kernels: KernelConfig = BASE, prefill_tokens: int = 0
) -> list[dict]:
    """The distinct Pallas-Triton kernels of one decode step (`steps.decode`, as the engine compiles it) under
    `kernels` (resolved for an H200 here), lowered for CUDA from abstract inputs; with `prefill_tokens`, of a
    prefill call (`steps.prefill`) of `batch` chunks of that many tokens after `context` cached ones."""
    cfg = model_config(preset)
    params, kernels = param_shapes(cfg, "pallas"), kernels.for_device(H200)
    if prefill_tokens:
        step = prefill_step(params, cfg, batch, prefill_tokens, kernels, start=context)
    else:
        step = decode_step(params, cfg, batch, context, kernels)
    found: list[dict] = []
    jax.clear_caches()  # every kernel lowers afresh, so that the spy sees it
    with lowering_for_hopper(), capture_triton_modules(found):
        step.lower(lowering_platforms=("cuda",))
    unique = {}
    for k in found:
        unique.setdefault((k["ir"], k["grid"], k["num_warps"], k["num_stages"]), k)
    return list(unique.values())


def loop_instructions(sass: str) -> list[int]:
    """Instructions in each loop of a kernel's SASS (`cuobjdump -sass`), in code order: from a backward branch's
    target to the branch. A loop's count is what a warp issues per iteration (a KV block, a K tile), the number
    the kernels' changes are judged by where they are bound by instruction issue (docs/kernels.md)."""
    lines = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+((?:@!?U?P\w+\s+)?[A-Z][^;]*);", sass)]
    loops = []
    for addr, op in lines:
        to = re.search(r"\bBRA (0x[0-9a-f]+)", op)
        if to and int(to.group(1), 16) < addr:
            loops.append(sum(1 for a, _ in lines if int(to.group(1), 16) <= a <= addr))
    return loops


def compile_sm90(kernel: dict, workdir: Path) -> dict:
    """Compile one kernel's Triton IR for sm_90a with the triton wheel; its cubin's resource usage and the
    instructions of each of its loops."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # as XLA's Triton pipeline does (and no warning)
    import triton
    from triton.backends.compiler import GPUTarget

    src = workdir / f"{kernel['name']}_{abs(hash(kernel['ir'])) % 10**8}.ttir"
    src.write_text(kernel["ir"])
    compiled = triton.compile(
        str(src),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=kernel["num_warps"], num_stages=kernel["num_stages"]),
    )
    cubin = src.with_suffix(".cubin")
    cubin.write_bytes(compiled.asm["cubin"])
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    usage = subprocess.run(
        [str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    regs, shared = int(fields["REG"]), max(int(fields["SHARED"]), int(compiled.metadata.shared))
    per_sm = resident_programs(regs, kernel["num_warps"], shared)
    programs = math.prod(kernel["grid"])
    return dict(
        name=kernel["name"],
        grid=list(kernel["grid"]),
        programs=programs,
        num_warps=kernel["num_warps"],
        num_stages=kernel["num_stages"],
        registers=regs,
        spill_bytes=int(fields["LOCAL"]),
        stack_bytes=int(fields["STACK"]),
        shared_bytes=shared,
        programs_per_sm=per_sm,
        waves=round(programs / (SMS * per_sm), 2),
        loop_instructions=loop_instructions(sass),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-oss-20b", help="preset name or HF config.json path")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024, help="cached tokens before the step's")
    ap.add_argument(
        "--prefill", type=int, default=0, help="lower a prefill call of --batch chunks of this many tokens instead"
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME:field=value[,...]: KernelConfig fields over the base (repeatable)",
    )
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    variants = [("tree", BASE)] + parse_variants(ap, args.variant, BASE)
    if importlib.util.find_spec("triton") is None:
        raise SystemExit("inspect_kernels needs the triton wheel: pip install -e '.[inspect]'")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, kernels in variants:
            found = step_kernels(args.preset, args.batch, args.context, kernels, args.prefill)
            what = f"prefill {args.batch} x {args.prefill}" if args.prefill else f"batch {args.batch}"
            print(f"\n{name}: {args.preset}, {what}, context {args.context}: {len(found)} kernels")
            if args.batch >= kernels.linear_mosaic_rows and not args.prefill:
                print(
                    "(on Hopper this batch runs the q/k/v and o projections in Mosaic GPU, not the decode_linear "
                    "kernels below)"
                )
            print(
                f"{'kernel':40} {'grid':>16} {'warps':>5} {'stages':>6} {'regs':>5} {'spill B':>7} "
                f"{'smem B':>7} {'per SM':>6} {'waves':>6}  loop instructions"
            )
            for k in found:
                r = dict(variant=name, **compile_sm90(k, Path(tmp)))
                rows.append(r)
                print(
                    f"{r['name'][:40]:40} {'x'.join(map(str, r['grid'])):>16} {r['num_warps']:>5} "
                    f"{r['num_stages']:>6} {r['registers']:>5} {r['spill_bytes']:>7} {r['shared_bytes']:>7} "
                    f"{r['programs_per_sm']:>6} {r['waves']:>6}  {r['loop_instructions']}"
                )
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                dict(preset=args.preset, batch=args.batch, context=args.context, prefill=args.prefill, rows=rows),
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
