"""gptoss-jax: JAX/XLA serving for OpenAI's gpt-oss models.

The public names load on first use, so importing the package (or `gptoss_jax.config`, or the layers below it,
`sharding` and `pallas_kernels`) loads no engine and changes no process setting; `gptoss_jax.runtime` applies
those where a process starts serving.
"""

import importlib

_PUBLIC = {
    "LLM": "gptoss_jax.llm",
    "RequestOutput": "gptoss_jax.llm",
    "CompletionOutput": "gptoss_jax.llm",
    "SamplingParams": "gptoss_jax.sampling",
    "Engine": "gptoss_jax.engine",
    "StepOutput": "gptoss_jax.engine",
    "EngineConfig": "gptoss_jax.engine_config",
}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'gptoss_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
