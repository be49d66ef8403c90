"""Plan a device mesh without devices or weights: lower and compile the engine's decode and prefill steps
for an abstract mesh of N devices, then report per-device memory and every collective with its bytes.

    python -m tools.plan_mesh --preset gpt-oss-120b --devices 72 --mode max_throughput [--replicas 1]
        [--expert-dispatch {all_gather,all_to_all}] [--batch 64] [--context 8192] [--prefill-tokens 2048]
        [--layers 36] [--json out.json]

Runs on CPU: the mesh is `--devices` simulated host devices (set before any device is touched);
parameters, KV pools and inputs are `jax.ShapeDtypeStruct`s carrying their shardings (`tools.common`'s
steps), so nothing is allocated. Shapes:

* `--batch` sequences per attention rank (a replica group in low_latency, a device in max_throughput),
  each with `--context` tokens of KV cache (pages of 16) plus the sliding window pages; decode runs one
  token per sequence (`num_steps=1`, greedy sampling included). Prefill: one row per rank with a
  `--prefill-tokens` chunk, the last of its `--context` tokens.
* Memory: parameter and KV bytes per device are exact (sharded shapes); `temp` is XLA's temporary
  buffer size for the step on one device (CPU compiler: a guide to the GPU figure, not equal to it).
* Collectives: parsed from the compiled per-device HLO, each multiplied by how often it runs (while-loop
  trip counts: the layer scan runs `layers / 2` times). `bytes` is the result size; `sent` the bytes
  one device sends with ring algorithms: all-gather and reduce-scatter (n-1)/n of the full buffer,
  all-reduce 2 (n-1)/n, all-to-all (n-1)/n, collective-permute all of it. Collectives inside a
  `lax.cond` branch (logprobs, the sampler's full-sort path) are listed but left out of the totals.
  XLA:CPU carries bf16 collectives as f32; a compiled f32 collective whose kind and shape appear only as bf16
  in the module before optimization is counted at its bf16 size (`gpu_dtype`), as a GPU sends it.
* `--expert-dispatch all_to_all` (`sharding.a2a_dispatch`): XLA:CPU cannot compile `ragged_all_to_all`, so the
  step compiles with its emulation (`sharding.ragged.emulated`: an all-gather of every operand, which moves n
  times the data). Its collectives carry a named scope with the rows the real op moves per device at most on
  average; the planner counts one `ragged-all-to-all` of those rows in place of the gather (sent: (n-1)/n of
  them, uniform routing) and leaves the emulation's own offset exchanges out (`emulation`). For the dispatch
  the rows are exact on average over devices: forward every pair of the device's tokens, back every pair it got.

`--layers` compiles fewer layers (faster; memory and collective figures are reported for the full
layer count: parameter and KV bytes analytically, collectives per layer pair from the trip counts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels import REFERENCE
from sharding.ragged import EMULATED_SCOPE
from sharding.rules import DISPATCHES, make_layout
from tools.common import decode_step, model_config, param_shapes, prefill_step

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "bf16": 2,
    "f16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}


def per_device_bytes(sds) -> int:
    """Bytes one device holds of a sharded `ShapeDtypeStruct` tree."""
    total = 0
    for leaf in jax.tree.leaves(sds):
        mesh, spec = leaf.sharding.mesh, leaf.sharding.spec
        split = 1
        for axes in spec:
            for a in (axes if isinstance(axes, tuple) else (axes,)) if axes is not None else ():
                split *= mesh.shape[a]
        total += math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize // split
    return total


def _shape_bytes(text: str) -> int:
    """Bytes of an HLO type string: `f32[8,2880]{1,0}` or a tuple `(f32[2], bf16[4,4])`."""
    total = 0
    for dt, dims in re.findall(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]", text):
        if dt in DTYPE_BYTES:
            total += DTYPE_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _array_type(text: str) -> tuple[str, tuple[int, ...]]:
    """(dtype, dims) of the first array in an HLO type string."""
    m = re.search(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]", text)
    return m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)


_PRE_COLLECTIVE = re.compile(r"=\s*([a-z]+[0-9]*)\[([0-9,]*)\]\S*\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def source_dtypes(hlo_before: str) -> dict[tuple, set[str]]:
    """(kind, dims) -> the dtypes of the collectives of that kind and result shape in the module before XLA's
    optimizations (jax's own dtypes: bf16 stays bf16)."""
    out: dict[tuple, set[str]] = {}
    for dt, dims, kind in _PRE_COLLECTIVE.findall(hlo_before):
        out.setdefault((kind, tuple(int(d) for d in dims.split(",") if d)), set()).add(dt)
    return out


def _group_size(line: str, num_devices: int) -> int:
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2)))
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=", line)
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
    return num_devices if not m else 2


def parse_collectives(hlo: str, num_devices: int, dtypes_before: dict | None = None) -> list[dict]:
    """Every collective in the compiled module with how many times one step runs it. `dtypes_before`
    (`source_dtypes` of the module before optimization) restores the bf16 size of collectives XLA:CPU
    carries as f32; emulated ragged all-to-alls become `ragged-all-to-all` (module docstring)."""
    comps: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if m and not line.startswith(" "):
            name = m.group(1)
            comps[name] = []
            if line.startswith("ENTRY"):
                entry = name
            continue
        if name is not None and line.startswith(" "):
            comps[name].append(line)
    # how often each computation runs: callers' counts times while trip counts
    calls: dict[str, list[tuple[str, int]]] = {c: [] for c in comps}
    for c, lines in comps.items():
        for line in lines:
            trip = 1
            if " while(" in line:
                t = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                trip = int(t.group(1)) if t else 1
            for callee in re.findall(r"(?:body|condition|to_apply|calls)=%([\w.\-]+)", line):
                if callee in calls:
                    calls[callee].append((c, trip))
            m = re.search(r"branch_computations=\{([^}]*)\}", line)
            if m:
                for callee in re.findall(r"%([\w.\-]+)", m.group(1)):
                    if callee in calls:
                        calls[callee].append((c, 1))
    memo: dict[str, int] = {}

    def count(c: str) -> int:
        if c == entry:
            return 1
        if c not in memo:
            memo[c] = 0
            memo[c] = sum(count(parent) * trip for parent, trip in calls.get(c, []))
        return memo[c]

    out = []
    for c, lines in comps.items():
        for line in lines:
            m = re.match(
                r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(", line
            )
            if not m:
                continue
            kind, n = m.group(3), _group_size(line, num_devices)
            size = _shape_bytes(m.group(2))
            if "-start" in line.split("=")[1].split("(")[0] and kind in ("all-gather", "collective-permute"):
                size = _shape_bytes(m.group(2)) // 2  # start ops return (operand, result)
            dt, dims = _array_type(m.group(2))
            gpu_dtype = dt
            if dt == "f32" and (dtypes_before or {}).get((kind, dims)) == {"bf16"}:
                gpu_dtype, size = "bf16", size // 2
            op_name = re.search(r'op_name="([^"]*)"', line)
            where = op_name.group(1) if op_name else ""
            emulated = re.search(EMULATED_SCOPE + r"_(\d+)_rows", where)
            emulation = False
            if emulated and kind == "all-gather" and len(dims) >= 3 and dims[0] == n:  # the operands, gathered
                kind, size = "ragged-all-to-all", int(emulated.group(1)) * DTYPE_BYTES[gpu_dtype] * math.prod(dims[2:])
            elif emulated:
                emulation = True  # the emulation's offset exchanges: the real op takes offsets as operands
            # result sizes: an all-gather's is the full buffer, a reduce-scatter's one shard of it; a ragged
            # all-to-all's `size` is what the device sends, (n-1)/n of it to others under uniform routing
            factor = {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0, "reduce-scatter": n - 1}.get(
                kind, (n - 1) / n
            )
            out.append(
                dict(
                    kind=kind,
                    computation=c,
                    runs=count(c),
                    group=n,
                    bytes=size,
                    sent=int(size * factor),
                    gpu_dtype=gpu_dtype,
                    emulation=emulation,
                    where=where[-90:],
                    where_full=where,
                )
            )
    return out


def plan(args) -> dict:
    full = model_config(args.preset)
    cfg = dataclasses.replace(full, num_layers=args.layers) if args.layers else full
    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[args.dtype]
    if args.devices % args.replicas:
        raise SystemExit(f"--devices {args.devices} is not a multiple of --replicas {args.replicas}")
    layout = make_layout(args.devices // args.replicas, args.replicas, args.mode, dispatch=args.expert_dispatch)
    R = layout.num_ranks

    def abstract_step(kind: str, c):
        params = param_shapes(c, "reference", dtype, layout)
        if kind == "decode":
            return decode_step(params, c, args.batch, args.context - 1, REFERENCE, layout=layout, num_top=1)
        T = args.prefill_tokens
        return prefill_step(params, c, 1, T, REFERENCE, start=max(0, args.context - T), layout=layout, num_top=1)

    result = dict(
        preset=args.preset,
        devices=args.devices,
        replicas=args.replicas,
        model=layout.model_size,
        mode=args.mode,
        expert_dispatch=args.expert_dispatch,
        ranks=R,
        layers_compiled=cfg.num_layers,
        layers=full.num_layers,
        experts_padded=param_shapes(cfg, "reference", dtype, layout).layers.experts.down_bias.shape[1],
        batch_per_rank=args.batch,
        context=args.context,
        prefill_tokens=args.prefill_tokens,
        steps={},
    )
    scale_layers = full.num_layers / cfg.num_layers
    for kind in args.steps.split(","):
        step = abstract_step(kind, cfg)
        B, T = step.batch.tables.full_BM.shape[0], 1 if kind == "decode" else args.prefill_tokens
        t0 = time.time()
        lowered = step.lower()
        compiled = lowered.compile()
        seconds = time.time() - t0
        hlo = compiled.as_text()
        if args.hlo_dir:
            Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
            name = f"{Path(args.preset).stem}-{args.mode}-{args.expert_dispatch}-{args.devices}-{kind}.hlo.txt"
            (Path(args.hlo_dir) / name).write_text(hlo)
        mem = compiled.memory_analysis()
        colls = parse_collectives(hlo, args.devices, source_dtypes(lowered.as_text(dialect="hlo")))
        pairs, full_pairs = cfg.num_layers // 2, full.num_layers // 2
        for c in colls:
            c["per_layer_pair"] = "/layers/while/body" in c["where_full"]  # inside the layer scan, or once per step
            c["conditional"] = "cond/branch" in c["where_full"]  # a lax.cond branch (logprobs...): not every step
            c["runs_full_model"] = c["runs"] // pairs * full_pairs if c["per_layer_pair"] else c["runs"]
        every = [c for c in colls if not c["conditional"] and not c["emulation"]]
        total_sent = sum(c["sent"] * c["runs_full_model"] for c in every)
        cond_sent = sum(c["sent"] * c["runs_full_model"] for c in colls if c["conditional"] and not c["emulation"])
        tokens_per_device = B * T / R  # a device works for its rank's tokens
        whole = abstract_step(kind, full)  # memory of every layer, compiled or not
        result["steps"][kind] = dict(
            compile_s=round(seconds, 1),
            global_batch=B,
            tokens=B * T,
            pages_per_rank=dict(full=step.pages[0], sliding=step.pages[1]),
            param_bytes_per_device=per_device_bytes(whole.params),
            kv_bytes_per_device=per_device_bytes(whole.cache),
            temp_bytes_per_device=int(mem.temp_size_in_bytes) if mem else None,
            argument_bytes_per_device_compiled=int(mem.argument_size_in_bytes) if mem else None,
            collectives=colls,
            collectives_per_step=sum(c["runs_full_model"] for c in every),
            sent_bytes_per_device=int(total_sent),
            conditional_sent_bytes=int(cond_sent),
            sent_bytes_per_token=total_sent / tokens_per_device if tokens_per_device else None,
            layer_scale=scale_layers,
        )
    return result


def _gb(b: float) -> str:
    return f"{b / 1e9:.2f} GB"


def report(r: dict) -> None:
    print(
        f"{r['preset']}: {r['devices']} devices = {r['replicas']} replicas x {r['model']} model, {r['mode']}, "
        f"{r['expert_dispatch']} dispatch, "
        f"{r['ranks']} attention ranks, experts padded to {r['experts_padded']}, "
        f"compiled {r['layers_compiled']}/{r['layers']} layers"
    )
    for step, s in r["steps"].items():
        print(f"  {step}: global batch {s['global_batch']} ({s['tokens']} tokens), compile {s['compile_s']} s")
        print(
            f"    per device: params {_gb(s['param_bytes_per_device'])}, KV {_gb(s['kv_bytes_per_device'])}, "
            f"temp {_gb(s['temp_bytes_per_device'] or 0)} (compiled {r['layers_compiled']} layers)"
        )
        agg: dict[tuple, list] = {}
        for c in s["collectives"]:
            if c["emulation"]:
                continue
            key = (c["kind"], c["group"], c["bytes"], c["per_layer_pair"], c["conditional"])
            agg.setdefault(key, [0, c["where"]])[0] += c["runs_full_model"]
        for (kind, n, size, per_pair, cond), (runs, where) in sorted(
            agg.items(), key=lambda kv: (kv[0][4], -kv[0][2] * kv[1][0])
        ):
            print(
                f"    {kind:18s} group {n:3d} {size / 1e6:10.3f} MB x{runs:4d}"
                f"{' in the layers' if per_pair else ' once'}{' (conditional)' if cond else ''}  {where[-50:]}"
            )
        per_tok = s["sent_bytes_per_token"]
        print(
            f"    {s['collectives_per_step']} collectives, "
            f"sent per device per step {s['sent_bytes_per_device'] / 1e6:.2f} MB (all {r['layers']} layers; "
            f"conditional branches {s['conditional_sent_bytes'] / 1e6:.2f} MB more), per token of its rank "
            f"{per_tok / 1e3 if per_tok else 0:.1f} KB"
        )


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt-oss-120b", help="preset name or a HF config.json path")
    ap.add_argument("--devices", type=int, required=True, help="devices in the mesh (replicas x model)")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--mode", choices=("low_latency", "max_throughput"), default="low_latency")
    ap.add_argument(
        "--expert-dispatch", choices=DISPATCHES, default="all_gather", help="how tokens reach their experts' devices"
    )
    ap.add_argument("--batch", type=int, default=64, help="decode sequences per attention rank")
    ap.add_argument("--context", type=int, default=8192, help="KV tokens per sequence")
    ap.add_argument("--prefill-tokens", type=int, default=2048, help="prefill chunk per rank (one row)")
    ap.add_argument("--layers", type=int, default=None, help="compile this many layers (even)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", default="decode,prefill")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--hlo-dir", default=None, help="also dump the compiled HLO text here")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if not jax.config.jax_platforms:  # before anything touches a device
        jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.devices)
    res = plan(args)
    report(res)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
