"""Engine settings (`EngineConfig`) and the two shipped profiles, `configs/low_latency.yaml` and
`configs/max_throughput.yaml`.

Every shape the compiled steps see comes from a bucket list derived here, so a running server
compiles a fixed set of programs (all of them at start-up with `warmup: true`) and never one per
request.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from pathlib import Path
from typing import Any

import yaml

from gptoss_jax.config import PRESETS_DIR, ConfigError
from gptoss_jax.speculative import SpeculativeConfig
from pallas_kernels import KernelConfig, kv_quant


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 64  # sequences in the running batch
    # Tokens of a step's prefill call, padding included (rows and chunk length rounded up to their buckets; the
    # decode rows run in their own call, bounded by max_num_seqs).
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int = 512  # most prompt tokens of one sequence per step
    max_prefill_seqs: int = 4  # sequences packed into one prefill call
    decode_steps_per_call: int = 1  # tokens per decode call, sampled on device (multi-step)
    async_scheduling: bool = True  # schedule and dispatch a step before reading the previous one
    page_size: int = 16
    kv_cache_dtype: str = "auto"  # 'auto' (the model's dtype) or 'fp8' / 'fp8_e4m3' (pallas_kernels/kv_quant.py)
    # Fraction of each device's whole memory this engine may hold: weights, KV cache and step activations, as
    # vLLM's --gpu-memory-utilization; the KV cache gets what the weights and the activation reserve leave of it.
    gpu_memory_utilization: float = 0.9
    num_pages: int | None = None  # full-layer pages, overrides the memory fraction
    kv_cache_tokens: int | None = None  # same, in tokens
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # default: the model's limit, capped by the cache
    decode_batch_buckets: tuple[int, ...] | None = None  # default: powers of two up to max_num_seqs
    min_prefill_bucket: int = 16  # smallest padded prefill chunk
    min_context_bucket: int = 1024  # smallest padded block-table width, in tokens
    max_logprobs: int = 20  # largest `SamplingParams.logprobs` accepted
    # Decode buckets of up to this many rows also get a program for calls whose rows are all greedy without logits
    # processors, structured outputs or log-probabilities, traced without the sampler's conditionals (each makes the
    # device wait: 20b batch 1 +7.8%, BENCHMARKS §24); one more program per such bucket to compile. 0: none.
    greedy_program_rows: int = 8
    warmup: bool = False  # compile every bucket at start-up
    # Processes that trace and lower warm-up's programs in parallel (`gptoss_jax/lowering.py`); the engine's process
    # compiles them. None: one per two cores up to 8 on a GPU, none elsewhere; 0: lower in the engine's process.
    compile_workers: int | None = None
    # Devices (docs/SCALING.md): a (replicas x model_parallel) mesh. `parallel_mode` 'low_latency'
    # splits attention heads over model_parallel, 'max_throughput' gives every device its own sequences;
    # experts are split over model_parallel in both. KV page counts above are per attention rank.
    # `expert_dispatch` moves tokens to their experts' devices by 'all_gather' + reduce-scatter or by
    # 'all_to_all' (each pair only to its expert's device; sharding/expert_parallel.py).
    parallel_mode: str = "low_latency"
    model_parallel: int = 1
    replicas: int = 1
    expert_dispatch: str = "all_gather"
    # Which kernels run and their launch settings (`pallas_kernels.choice.KernelConfig`; YAML: a `kernels:` mapping).
    kernels: KernelConfig = KernelConfig()
    # Speculative decoding (`speculative.SpeculativeConfig`, vLLM's `speculative_config`: a mapping or JSON string
    # such as {"method": "ngram", "num_speculative_tokens": 3}); None: off. docs/engine.md.
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self):
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if isinstance(self.kernels, dict):
            try:
                object.__setattr__(self, "kernels", KernelConfig.from_dict(self.kernels, "EngineConfig.kernels"))
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if not isinstance(self.kernels, KernelConfig):
            raise ConfigError(f"EngineConfig.kernels={self.kernels!r}: a mapping of kernel settings")
        positive = (
            "max_num_seqs",
            "max_num_batched_tokens",
            "prefill_chunk_size",
            "max_prefill_seqs",
            "decode_steps_per_call",
            "page_size",
            "min_prefill_bucket",
            "min_context_bucket",
        )
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"EngineConfig.{name}={v!r}: must be an integer >= 1")
        w = self.compile_workers
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 0):
            raise ConfigError(f"EngineConfig.compile_workers={w!r}: must be an integer >= 0 or null")
        for name in ("num_pages", "kv_cache_tokens", "max_model_len"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 2):
                raise ConfigError(f"EngineConfig.{name}={v!r}: must be an integer >= 2 or null")
        g = self.greedy_program_rows
        if not isinstance(g, int) or isinstance(g, bool) or g < 0:
            raise ConfigError(f"EngineConfig.greedy_program_rows={g!r}: must be an integer >= 0 (0: none)")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ConfigError(f"EngineConfig.max_logprobs={self.max_logprobs!r}: must be an integer >= 0")
        f = self.gpu_memory_utilization
        if not isinstance(f, (int, float)) or isinstance(f, bool) or not 0 < f <= 1:
            raise ConfigError(f"EngineConfig.gpu_memory_utilization={f!r}: must be in (0, 1]")
        if self.prefill_chunk_size > self.max_num_batched_tokens:
            raise ConfigError(
                f"EngineConfig.prefill_chunk_size={self.prefill_chunk_size} exceeds "
                f"max_num_batched_tokens={self.max_num_batched_tokens}"
            )
        if self.decode_batch_buckets is not None:
            b = self.decode_batch_buckets
            if not b or any(not isinstance(x, int) or x < 1 for x in b) or max(b) < self.max_num_seqs:
                raise ConfigError(
                    f"EngineConfig.decode_batch_buckets={b!r}: positive integers whose largest "
                    f"is at least max_num_seqs={self.max_num_seqs}"
                )
            object.__setattr__(self, "decode_batch_buckets", tuple(sorted(set(b))))
        for name in ("model_parallel", "replicas"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"EngineConfig.{name}={v!r}: must be an integer >= 1")
        if self.kv_cache_dtype not in kv_quant.DTYPES:
            raise ConfigError(
                f"EngineConfig.kv_cache_dtype={self.kv_cache_dtype!r}: one of {sorted(kv_quant.DTYPES)} "
                "(fp8 is e4m3 with a scale per token and KV head; e5m2 is not supported)"
            )
        if self.parallel_mode not in ("low_latency", "max_throughput"):
            raise ConfigError(f"EngineConfig.parallel_mode={self.parallel_mode!r}: 'low_latency' or 'max_throughput'")
        if self.expert_dispatch not in ("all_gather", "all_to_all"):
            raise ConfigError(f"EngineConfig.expert_dispatch={self.expert_dispatch!r}: 'all_gather' or 'all_to_all'")
        if self.speculative_config is not None and self.model_parallel * self.replicas > 1:
            raise ConfigError(
                "EngineConfig.speculative_config: speculative decoding runs on one device for now "
                f"(model_parallel={self.model_parallel}, replicas={self.replicas})"
            )
        for name in ("enable_prefix_caching", "warmup", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"EngineConfig.{name}={getattr(self, name)!r}: must be true or false")

    def decode_tokens_per_call(self, drafts: bool = True) -> int:
        """The most positions one decode call computes per sequence: one per step, or with speculation the last token
        and the drafts of each step (one per step in a call that does not draft: `disable_by_batch_size`)."""
        spec = self.speculative_config
        return self.decode_steps_per_call * (1 + (spec.num_speculative_tokens if spec is not None and drafts else 0))

    # ---- buckets -------------------------------------------------------------------------------
    def decode_buckets(self) -> tuple[int, ...]:
        return self.decode_batch_buckets or pow2_buckets(1, self.max_num_seqs)

    def prefill_row_buckets(self) -> tuple[int, ...]:
        return pow2_buckets(1, self.max_prefill_seqs)

    def prefill_token_buckets(self) -> tuple[int, ...]:
        return pow2_buckets(min(self.min_prefill_bucket, self.prefill_chunk_size), self.prefill_chunk_size)

    def context_buckets(self, max_model_len: int) -> tuple[int, ...]:
        """Block-table widths in pages; the last covers `max_model_len` (multi-step decode may run past
        it on device, into tokens that are discarded; their writes go to the null page)."""
        most = math.ceil(max_model_len / self.page_size)
        least = min(most, math.ceil(self.min_context_bucket / self.page_size))
        return pow2_buckets(least, most)


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """`lo, 2*lo, 4*lo, ...` below `hi`, then `hi` itself."""
    out = []
    b = lo
    while b < hi:
        out.append(b)
        b *= 2
    return tuple(out + [hi])


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def padded_rows(per_rank: list[int], buckets: tuple[int, ...]) -> int:
    """Rows of a call whose attention ranks hold `per_rank` sequences: each rank's share padded to the same bucket
    (rows are rank-major). The runner pads its calls so, and the scheduler budgets prefill calls by it."""
    return len(per_rank) * bucket(max(max(per_rank), 1), buckets)


# Settings whose meaning changed with their name: a clear error rather than a silent reinterpretation.
RENAMED = {
    "kv_cache_memory_fraction": (
        "gpu_memory_utilization",
        "the fraction of the whole device for weights, KV cache and activations, as vLLM's "
        "--gpu-memory-utilization; the old key was a fraction of the memory left after the weights",
    ),
}


def load(source: EngineConfig | str | Path | None, **overrides: Any) -> EngineConfig:
    """An `EngineConfig` from an instance, a YAML file or profile name ('low_latency',
    'max_throughput'), or defaults; keyword overrides win (a `kernels` mapping over the file's mapping: setting by
    setting, so overriding one kernel setting keeps the profile's others). Unknown keys are errors naming the file."""
    if isinstance(source, EngineConfig):
        return dataclasses.replace(source, **overrides) if overrides else source
    raw: dict[str, Any] = {}
    where = "EngineConfig"
    if source is not None:
        path = Path(source)
        if not path.suffix and not path.exists():
            path = PRESETS_DIR / f"{source}.yaml"
        if not path.exists():
            known = sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))
            raise ConfigError(f"engine config {source}: file not found (profiles: {known})")
        where = str(path)
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of settings at top level")
    if isinstance(raw.get("kernels"), dict) and isinstance(overrides.get("kernels"), dict):
        overrides = dict(overrides, kernels={**raw["kernels"], **overrides["kernels"]})
    raw.update(overrides)
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    for key in raw:
        if key in RENAMED:
            raise ConfigError(f"{where}: '{key}' is now '{RENAMED[key][0]}' ({RENAMED[key][1]})")
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.5)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(f"{where}: unknown engine setting '{key}' ({hint}known: {sorted(known)})")
    if isinstance(raw.get("decode_batch_buckets"), list):
        raw["decode_batch_buckets"] = tuple(raw["decode_batch_buckets"])
    try:
        return EngineConfig(**raw)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
