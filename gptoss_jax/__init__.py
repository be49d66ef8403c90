"""gptoss-jax: JAX/XLA serving for OpenAI's gpt-oss models."""

from gptoss_jax.engine import Engine, StepOutput
from gptoss_jax.engine_config import EngineConfig
from gptoss_jax.llm import LLM, CompletionOutput, RequestOutput
from gptoss_jax.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Engine", "EngineConfig", "StepOutput"]
