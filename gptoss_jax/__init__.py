"""gptoss-jax: JAX/XLA serving for OpenAI's gpt-oss models."""

import os

# JAX preallocates 75% of GPU memory unless told otherwise; the KV cache is sized from what that pool
# leaves after the weights, and on one H200 75% starves gpt-oss-120b (91 preemptions in the 1k/1k job,
# docs/BENCHMARKS.md §4b). An engine wants nearly all of it, as vLLM's gpu_memory_utilization=0.9 does.
# Read when the GPU backend starts, so this must run before any device is touched; an explicit value wins.
GPU_MEMORY_FRACTION = "0.92"
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEMORY_FRACTION)

from gptoss_jax.engine import Engine, StepOutput  # noqa: E402
from gptoss_jax.engine_config import EngineConfig  # noqa: E402
from gptoss_jax.llm import LLM, CompletionOutput, RequestOutput  # noqa: E402
from gptoss_jax.sampling import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Engine", "EngineConfig", "StepOutput"]
