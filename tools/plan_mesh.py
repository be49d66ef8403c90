"""Plan a device mesh without devices or weights: lower and compile the engine's decode and prefill steps
for an abstract mesh of N devices, then report per-device memory and every collective with its bytes.

    python -m tools.plan_mesh --preset gpt-oss-120b --devices 72 --mode max_throughput [--replicas 1]
        [--batch 64] [--context 8192] [--prefill-tokens 2048] [--layers 36] [--json out.json]

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
  XLA:CPU carries bf16 collectives as f32, so bf16 activation gathers show twice their GPU size.

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
from sharding.rules import make_layout
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


def parse_collectives(hlo: str, num_devices: int) -> list[dict]:
    """Every collective in the compiled module with how many times one step runs it."""
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
            # result sizes: an all-gather's is the full buffer, a reduce-scatter's one shard of it
            factor = {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0, "reduce-scatter": n - 1}.get(
                kind, (n - 1) / n
            )
            op_name = re.search(r'op_name="([^"]*)"', line)
            out.append(
                dict(
                    kind=kind,
                    computation=c,
                    runs=count(c),
                    group=n,
                    bytes=size,
                    sent=int(size * factor),
                    where=op_name.group(1)[-90:] if op_name else "",
                    where_full=op_name.group(1) if op_name else "",
                )
            )
    return out


def plan(args) -> dict:
    full = model_config(args.preset)
    cfg = dataclasses.replace(full, num_layers=args.layers) if args.layers else full
    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[args.dtype]
    if args.devices % args.replicas:
        raise SystemExit(f"--devices {args.devices} is not a multiple of --replicas {args.replicas}")
    layout = make_layout(args.devices // args.replicas, args.replicas, args.mode)
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
        compiled = step.lower().compile()
        seconds = time.time() - t0
        hlo = compiled.as_text()
        if args.hlo_dir:
            Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
            (Path(args.hlo_dir) / f"{args.preset}-{args.mode}-{args.devices}-{kind}.hlo.txt").write_text(hlo)
        mem = compiled.memory_analysis()
        colls = parse_collectives(hlo, args.devices)
        pairs, full_pairs = cfg.num_layers // 2, full.num_layers // 2
        for c in colls:
            c["per_layer_pair"] = "/layers/while/body" in c["where_full"]  # inside the layer scan, or once per step
            c["conditional"] = "cond/branch" in c["where_full"]  # a lax.cond branch (logprobs...): not every step
            c["runs_full_model"] = c["runs"] // pairs * full_pairs if c["per_layer_pair"] else c["runs"]
        total_sent = sum(c["sent"] * c["runs_full_model"] for c in colls if not c["conditional"])
        cond_sent = sum(c["sent"] * c["runs_full_model"] for c in colls if c["conditional"])
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
            f"    sent per device per step {s['sent_bytes_per_device'] / 1e6:.2f} MB (all {r['layers']} layers; "
            f"conditional branches {s['conditional_sent_bytes'] / 1e6:.2f} MB more), per token of its rank "
            f"{per_tok / 1e3 if per_tok else 0:.1f} KB"
        )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt-oss-120b", help="preset name or a HF config.json path")
    ap.add_argument("--devices", type=int, required=True, help="devices in the mesh (replicas x model)")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--mode", choices=("low_latency", "max_throughput"), default="low_latency")
    ap.add_argument("--batch", type=int, default=64, help="decode sequences per attention rank")
    ap.add_argument("--context", type=int, default=8192, help="KV tokens per sequence")
    ap.add_argument("--prefill-tokens", type=int, default=2048, help="prefill chunk per rank (one row)")
    ap.add_argument("--layers", type=int, default=None, help="compile this many layers (even)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", default="decode,prefill")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--hlo-dir", default=None, help="also dump the compiled HLO text here")
    args = ap.parse_args(argv)
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
