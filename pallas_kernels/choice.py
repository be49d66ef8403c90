"""Which kernel runs each operation, with which launch settings: `choose`, the one place that decides, from the
call's rows, the model's shape, the dtype, the device and the engine's `KernelConfig`.

`KernelConfig` holds every switch and launch setting a benchmark may vary (YAML: `kernels:` in an engine config;
tools build variants of it, nothing patches a module). Its defaults are the measured best on an H200; the
measurements are cited beside each field (docs/BENCHMARKS.md, docs/kernels.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import kv_quant, linear_decode, linear_mosaic, moe_dense, moe_mosaic

IMPLS = ("reference", "pallas")
OPS = ("attention", "projection", "moe", "experts")


@dataclasses.dataclass(frozen=True)
class Device:
    """What the choice needs to know of the accelerator: Mosaic GPU kernels need Hopper (wgmma exists on sm_90: not
    on Ampere, and Blackwell has tcgen05 instead); the projection kernel's splits aim at one wave of SMs."""

    platform: str = "cpu"
    compute_capability: str = ""
    num_sms: int = 0

    @classmethod
    def current(cls) -> Device:
        dev = jax.devices()[0]
        return cls(
            dev.platform, str(getattr(dev, "compute_capability", "") or ""), int(getattr(dev, "core_count", 0) or 0)
        )

    @property
    def hopper(self) -> bool:
        return self.platform == "gpu" and self.compute_capability.startswith("9")


CPU = Device()
H100 = Device("gpu", "9.0", 132)
H200 = Device("gpu", "9.0", 132)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """The kernel switches and launch settings of an engine (`EngineConfig.kernels`). Row and token limits
    (`*_rows`, `*_tokens`) may be 0: that kernel then never runs."""

    # "pallas" (the kernels), "reference" (pure JAX), or "auto": the kernels on GPUs, the reference elsewhere (the
    # Pallas-Triton kernels only lower for GPUs; anywhere else they would run interpreted).
    impl: str = "auto"
    # The Mosaic GPU kernels (projections from 8 rows, mid-batch MoE, the 20b prefill's grouped GEMMs): None = where
    # the device is Hopper; false runs the Pallas-Triton kernels at every batch size.
    mosaic: bool | None = None

    # Attention. Decode up to `new_token_rows` tokens (one a row, or a few: `attention_rows_tokens`) takes the
    # new-token kernel, which also sums the q/k/v projections' partials, adds their biases, applies RoPE and writes
    # the cache: the 20b batch-1 step went from 2.45 to 2.24 ms, and the gain holds up to 256 rows (BENCHMARKS §7c).
    new_token_rows: int = 256
    attention_block_kv: int = 64  # keys per block of the decode kernels
    attention_stages: int = 3  # their Triton pipeline stages
    # 2 warps, not 4: a 20b verify step's attention (batch 1, k = 3, 1k context) took 218 against 314 us, the step
    # 3,099 against 3,179 us; 64 rows at 8,192 context and concurrency 8 and 32 are no slower (BENCHMARKS §33)
    attention_warps: int = 2
    # The same over an FP8 KV cache (values `[P, K, H, S]`): its best of four launches in the H200 sweep at 64 rows x
    # 8,192 and 8 x 32,768 context, 243.4 and 131.0 us (128/5/4: 252.9 and 135.0; 64/3/4: 295.5 and 172.1), where
    # bf16 took 302.7 and 162.2 at its own 64/3/4 (BENCHMARKS §17).
    attention_fp8_block_kv: int = 128
    attention_fp8_stages: int = 5  # 5 stages: two K/V buffers (docs/kernels.md)
    attention_fp8_warps: int = 2
    # Sequence splits aim at this many programs (~4 per SM on 132 SMs). 512 rather than 1,024: the 20b decode step at
    # 64 rows of 8,192 context took 11.23 against 12.41 ms (one split a (row, KV head) instead of two, BENCHMARKS §16);
    # up to 2 rows (32 splits, the cap) and from 128 (1 split) nothing changes. A sliding layer takes at most one split
    # per block its window can cover (`paged_attention._geometry`).
    attention_split_programs: int = 512
    attention_max_splits: int = 32  # splits per (row, KV head), at most
    # Up to this many tokens per row (a speculative verify step: k + 1) a decode kernel attends, one query row per
    # token, each to its causal prefix: its sequence splits keep the SMs busy, where the prefill kernel gave a few
    # programs a whole context each (20b verify step, k = 3: BENCHMARKS §13d). The new-token kernel takes them where
    # it runs (its split 0 attends to the row's earlier new tokens from their projections); elsewhere (several
    # devices, inspection) XLA writes their K/V first and the paged kernel attends.
    attention_rows_tokens: int = 8
    # Prefill chunks: (token, head) rows per tile (a multiple of the GQA group), keys per block. The best of eight
    # launches in the H200 sweep at 8 chunks of 2,048 after 6,144 cached (the engine's long-prompt call), 6.78 ms bf16
    # (64/64/4: 7.84; at one fresh 8,192 prompt 1.85 against 1.71), and with an FP8 cache 8.96 ms at 128/64/4 (64/64/4:
    # 12.45; 8 warps, bf16's best: 14.52), BENCHMARKS §18.
    flash_block_q: int = 128
    flash_block_kv: int = 64
    flash_warps: int = 8
    flash_stages: int = 3
    flash_fp8_block_q: int = 128
    flash_fp8_block_kv: int = 64
    flash_fp8_warps: int = 4
    flash_fp8_stages: int = 3

    # Projections. Up to 7 rows run the Triton GEMV (the Mosaic kernel pads to 8 token rows: at 2 and 4 rows the
    # step was 8-11% slower with it, 20b and 120b, BENCHMARKS §13b; at 8 the same); from `linear_mosaic_rows` to 256
    # rows the Mosaic kernel runs every weight in one launch (Hopper, BENCHMARKS §4f); else the Triton GEMV up to
    # `linear_gemv_rows` (at most `linear_decode.MAX_ROWS`), with q, k and v in one launch up to `linear_fuse_rows`
    # rows (small weights cost launch latency, not bytes; the 3 branches' pipelines fit shared memory); beyond, XLA's
    # GEMM amortises its copy of the layer slice.
    linear_mosaic_rows: int = 8
    linear_gemv_rows: int = 64
    linear_fuse_rows: int = 16
    # The GEMV's launch (BENCHMARKS §7d, 20b and 120b batch-1 step): ~1,056 programs of 128-wide K steps beat 528 of
    # 256 by 2.5%; 2,112 programs, K steps of 512, 16-row tiles or 8 warps were slower. 2 warps and 2 stages rather
    # than 4 and 3: at 4 rows (a verify step's) the 20b and 120b steps 0.6% and 0.8% faster, at 1 row the same (§29).
    linear_block_n: int = 32
    linear_block_k: int = 128
    linear_programs: int = 1056
    linear_warps: int = 2
    linear_stages: int = 2

    # MoE. Up to `moe_route_max_tokens` tokens of a bf16 model (while experts average <= 2 routed rows) the block
    # is one front-end kernel (norm, router, GEMV operand), the routed half-precision GEMVs and one back-end kernel
    # (expert sum, residual add, next norm): 12-14% faster at 1 token and 8-9% at 4 (BENCHMARKS §7b), 8-10% at 8
    # (§13b: 20b and 120b; a speculative verify step of k = 7 has 8 rows); at 16, 6% faster for 20b in §13b but 0-4%
    # slower in §7b, so not yet taken.
    moe_route_max_tokens: int = 8
    moe_route_experts_per_program: int = 4
    moe_back_warps: int = 8  # 4 and 8 time the same (BENCHMARKS §7f)
    # From `moe_dense_rows` routed rows per expert (on average) the experts are dequantized and run as dense GEMMs
    # (best of the H200 sweep at 8,192 tokens, BENCHMARKS §2d); bf16 models of up to `moe_grouped_experts` experts on
    # Hopper take jax's Mosaic GPU ragged dot for them (§4g, §17).
    moe_dense_rows: int = 64
    # bf16 models of more than 32 experts run the dense GEMMs (grouped or in Triton groups) only from
    # `moe_dense_tile_rows` rows per expert: below, half of their 128-row tiles are empty, and the fused "mma" kernel
    # with 128-row tiles is faster (H200, 120b: 3.11 against 4.83 ms a layer at 2,048 tokens, equal at 4,096;
    # BENCHMARKS §15).
    moe_dense_tile_rows: int = 128
    # On Hopper, bf16 models with at most this many experts run those dense GEMMs on the grouped Mosaic GPU ragged dot,
    # every expert of the layer dequantized at once (20b's 32: 1.6 GB; 120b's 128: 6.4 GB, which
    # `kv_cache.activation_bytes` reserves either way); past 32 experts only from `moe_dense_tile_rows` rows per
    # expert. 120b on an H200, a 2 x 8,192-token prefill call: 535.6 against 585.8 ms on the Triton GEMMs in groups
    # of 32; its 8,192/1,024 job +7.7% (BENCHMARKS §17). 32 keeps the 120b on the Triton GEMMs.
    moe_grouped_experts: int = 128
    # Keep a bf16 copy of the experts, made once at load, for those grouped GEMMs (the only kernels that read it)
    # instead of dequantizing every expert of the layer in each call: that dequantization was 15.6 of the 40.0 ms of
    # a 1 x 1,024-token prefill call (batch-1 TTFT) and 15.7 of 269.8 ms at 2 x 8,192 (20b, H200, BENCHMARKS §16).
    # It costs 38.2 GB for 20b (beside 13.4 GB of MXFP4 weights), taken from the KV cache; the max_throughput profile
    # turns it on (20b 8k/1k: 4,344 -> 4,356-4,639, BENCHMARKS §21-§22). Skipped, with the reason logged at load, where
    # the grouped GEMMs never run (fp32, no Mosaic, more experts a device than `moe_grouped_experts`) or where the copy
    # would take more than half the devices' free memory (20b on 80 GB; 120b: 229 GB, made over 4 devices: 57 GB each).
    moe_prefill_bf16_experts: bool = False
    # bf16 models from 2 to `moe_mosaic_rows` routed rows per expert take the Mosaic GPU kernels on Hopper: 20b
    # batch 256 in 16.6 ms against 18.5 ms for the Triton kernels (§4c).
    moe_mosaic_rows: int = 32
    moe_mosaic_stages: int = 2

    # The layer scan takes two layer pairs a step (where the pairs are even: the 20b's and the 120b's) in calls of at
    # most this many tokens (rows x tokens a row): a scan step costs the counter's increment, a one-thread kernel, and
    # a launch gap, ~2.8 us. At batch 1 (k = 3) the 20b went from 901.3 to 904.9 tok/s end to end; at 8 and 32 rows
    # 3-4% slower, cause not found (BENCHMARKS §34-35).
    scan_pairs_tokens: int = 4

    # Filled by `for_device`, never by a config file: the device the choice is for.
    device: Device | None = None

    def __post_init__(self):
        if self.impl not in ("auto",) + IMPLS:
            raise ValueError(f"kernels.impl={self.impl!r}: choose one of {('auto',) + IMPLS}")
        if self.mosaic not in (None, True, False):
            raise ValueError(f"kernels.mosaic={self.mosaic!r}: true, false or null (Hopper decides)")
        if not isinstance(self.moe_prefill_bf16_experts, bool):
            raise ValueError(f"kernels.moe_prefill_bf16_experts={self.moe_prefill_bf16_experts!r}: true or false")
        for f in dataclasses.fields(self):
            v, least = getattr(self, f.name), 0 if f.name.endswith(("_rows", "_tokens")) else 1
            if f.type == "int" and (not isinstance(v, int) or isinstance(v, bool) or v < least):
                raise ValueError(
                    f"kernels.{f.name}={v!r}: must be an integer >= {least}" + (" (0: never)" if least == 0 else "")
                )
        if self.linear_gemv_rows > linear_decode.MAX_ROWS:
            raise ValueError(
                f"kernels.linear_gemv_rows={self.linear_gemv_rows}: the GEMV kernel takes at most "
                f"{linear_decode.MAX_ROWS} rows"
            )
        if self.device is not None and not isinstance(self.device, Device):
            raise ValueError(f"kernels.device={self.device!r}: detected, not configured")

    def for_device(self, device: Device | None = None) -> KernelConfig:
        """This config with "auto" and None resolved for `device` (default: the first JAX device), which it then
        carries: what the model and the loader are given."""
        device = device or self.device or Device.current()
        return dataclasses.replace(self, impl=self.impl_on(device), mosaic=self.mosaic_on(device), device=device)

    def impl_on(self, device: Device) -> str:
        return self.impl if self.impl != "auto" else ("pallas" if device.platform == "gpu" else "reference")

    def mosaic_on(self, device: Device) -> bool:
        return device.hopper if self.mosaic is None else self.mosaic

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "kernels") -> KernelConfig:
        """From a config file's `kernels:` mapping; unknown keys are errors naming them."""
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: expected a mapping of kernel settings, got {raw!r}")
        known = {f.name for f in dataclasses.fields(cls)} - {"device"}
        for key in raw:
            if key not in known:
                raise ValueError(f"{where}: unknown kernel setting '{key}' (known: {sorted(known)})")
        return cls(**raw)


REFERENCE = KernelConfig(impl="reference")  # pure JAX on every device


@dataclasses.dataclass(frozen=True)
class Choice:
    """A kernel and its launch settings (keyword arguments of the kernel's entry point)."""

    kernel: str
    launch: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def kw(self) -> dict[str, Any]:
        return dict(self.launch)


def _choice(kernel: str, **launch) -> Choice:
    return Choice(kernel, launch)


def choose(op: str, rows: int, shape: tuple[int, ...], dtype, device: Device, config: KernelConfig) -> Choice:
    """The kernel for `op` on `rows` rows of a model of `shape`, in `dtype`, on `device`, under `config`:

    - "attention": rows = sequences, shape = (tokens per row, q heads, KV heads, head dim), dtype = the KV cache's
      (an FP8 cache's decode takes its own launch settings) -> "reference"; "new_token" (one or a few tokens per
      row, up to `new_token_rows` tokens), else "paged" (one token per row) or "paged_rows" (a few); "flash"
      (prefill chunks).
    - "projection": rows = tokens, shape = (input features, output features of each weight sharing the input)
      -> "reference" (XLA's GEMM), "mosaic" or "gemv" (`fuse`: the weights share one launch).
    - "moe": rows = tokens, shape = (hidden, intermediate, experts, top-k) -> "route" (the fused decode block) or
      any "experts" choice.
    - "experts": as "moe", routing given -> "reference", "gemv16", "gemv", "mma", "mosaic", "dense", "grouped".
    """
    impl, mosaic = config.impl_on(device), config.mosaic_on(device)
    half = jnp.dtype(dtype) != jnp.dtype(jnp.float32)
    if op not in OPS:
        raise ValueError(f"unknown operation {op!r}; choose one of {OPS}")
    if impl == "reference":
        return Choice("reference")
    c = config
    if op == "attention":
        T, fp8 = shape[0], kv_quant.is_quantized(dtype)
        decode_kw = dict(
            block_kv=c.attention_fp8_block_kv if fp8 else c.attention_block_kv,
            num_stages=c.attention_fp8_stages if fp8 else c.attention_stages,
            num_warps=c.attention_fp8_warps if fp8 else c.attention_warps,
            split_programs=c.attention_split_programs,
            max_splits=c.attention_max_splits,
        )
        if T > max(1, c.attention_rows_tokens):
            return _choice(
                "flash",
                block_q=c.flash_fp8_block_q if fp8 else c.flash_block_q,
                block_kv=c.flash_fp8_block_kv if fp8 else c.flash_block_kv,
                num_warps=c.flash_fp8_warps if fp8 else c.flash_warps,
                num_stages=c.flash_fp8_stages if fp8 else c.flash_stages,
            )
        if rows * T <= c.new_token_rows:
            return _choice("new_token", **decode_kw)
        return _choice("paged_rows" if T > 1 else "paged", **decode_kw)
    if op == "projection":
        I, *Os = shape
        if mosaic and c.linear_mosaic_rows <= rows and linear_mosaic.fits(rows, I, dtype):
            return _choice("mosaic", **linear_mosaic.config(rows, I, Os, device.num_sms or 132))
        if rows <= c.linear_gemv_rows:
            return _choice(
                "gemv",
                fuse=rows <= c.linear_fuse_rows,
                block_n=c.linear_block_n,
                block_k=c.linear_block_k,
                programs=c.linear_programs,
                num_warps=c.linear_warps,
                num_stages=c.linear_stages,
            )
        return Choice("reference")
    D, I, E, k = shape
    pairs = rows * k
    if op == "moe" and half and rows <= c.moe_route_max_tokens and pairs <= 2 * E:
        return _choice(
            "route",
            experts_per_program=c.moe_route_experts_per_program,
            back_warps=c.moe_back_warps,
            gemv=_gemv16(rows)[1],
        )
    if pairs >= c.moe_dense_rows * E:
        rows_ok = E <= moe_dense.GROUP or pairs >= c.moe_dense_tile_rows * E
        if half and mosaic and rows_ok and moe_dense.grouped_fits(D, I, E, pairs, c.moe_grouped_experts):
            return Choice("grouped")
        if half and pairs < c.moe_dense_tile_rows * E:
            return _choice(
                "mma", block_m=128, block_n=64, block_k=128, block_n_down=64, num_warps=4, num_stages=3, swap=True
            )
        return _choice("dense", block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, group=moe_dense.GROUP)
    if half and mosaic and 2 * E < pairs <= c.moe_mosaic_rows * E and moe_mosaic.fits(D, I):
        # 16-row slots up to 8 rows per expert, else 32 (per weight on the H200, §2e: 3.2e12 weights/s with 8-row
        # slots, 2.6e12 with 16, 2.4e12 with 32, 1.0e12 with 64, where three stages no longer fit shared memory)
        return _choice("mosaic", block_m=16 if pairs <= 8 * E else 32, stages=c.moe_mosaic_stages)
    return _fused(rows, pairs, E, half)


def bf16_experts_unused(shape: tuple[int, int, int], dtype, device: Device, config: KernelConfig) -> str:
    """Why a bf16 copy of the experts (`KernelConfig.moe_prefill_bf16_experts`) would never be read for a model of
    `shape` (hidden, intermediate, experts) in `dtype` on `device`: the reason, or "" where the grouped GEMMs run
    (the only kernels that read it)."""
    D, I, E = shape
    if config.impl_on(device) == "reference":
        return "the pure-JAX reference runs (kernels.impl), not the kernels"
    if jnp.dtype(dtype) == jnp.dtype(jnp.float32):
        return "an fp32 model: the grouped GEMMs run in bf16"
    if not config.mosaic_on(device):
        return "no Mosaic GPU kernels here (they need Hopper; kernels.mosaic)"
    if not moe_dense.grouped_fits(D, I, E, 128, config.moe_grouped_experts):
        return (
            f"{E} experts of {D} x {I} a device do not take the grouped GEMMs (at most kernels.moe_grouped_experts="
            f"{config.moe_grouped_experts}, D and I multiples of 64 from 256)"
        )
    return ""


def _gemv16(rows: int) -> tuple[str, dict]:
    """The half-precision GEMV's launch: register double buffering pays only in the down kernel at one token (in
    gate/up the doubled tiles cost more occupancy than they hide latency, BENCHMARKS §7d)."""
    return "gemv16", dict(
        block_n=16,
        block_k=512 if rows == 1 else 1024,
        block_n_down=16,
        num_warps=4,
        num_stages=1,
        prefetch=False,
        prefetch_down=rows == 1,
    )


def _fused(rows: int, pairs: int, E: int, half: bool) -> Choice:
    """Below the dense regime, where the Mosaic kernels do not run (best of the H200 sweeps, docs/kernels.md):
    bf16 models take the half-precision GEMV, one pair per slot, while experts average <= 2 routed rows; fp32
    models the f32 GEMV while they average <= 1; beyond, tensor cores amortise the decode over a slot's rows."""
    if half and pairs <= 2 * E:
        name, launch = _gemv16(rows)
        return _choice(name, block_m=1, **launch)
    if not half and pairs <= E:
        return _choice(
            "gemv",
            block_m=1,
            block_n=16,
            block_k=512,
            block_n_down=16,
            num_warps=4,
            num_stages=1,
            prefetch=rows == 1,
            prefetch_down=rows == 1,
        )
    bm = 16
    while bm < 64 and bm < 2 * pairs / E:
        bm *= 2
    if bm == 64:  # >= 16 rows per expert: wider feature tiles, decoded weights as the register operand
        return _choice(
            "mma", block_m=64, block_n=64, block_k=128, block_n_down=64, num_warps=4, num_stages=3, swap=True
        )
    return _choice("mma", block_m=bm, block_n=32, block_k=256, block_n_down=32, num_warps=4, num_stages=3)
