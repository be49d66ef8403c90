"""Request models (pydantic, strict types) and OpenAI-style errors."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gptoss_jax.sampling import INT32_MAX, PENALTY_RANGE, SEED_RANGE


class APIError(Exception):
    """Becomes `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def validation_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err.get("loc", ()))
    kind = err.get("type", "")
    if kind == "missing":
        msg = f"Missing required parameter: '{loc}'."
    elif kind == "extra_forbidden":
        msg = f"Unrecognized request argument supplied: {loc}"
    else:
        msg = f"Invalid value for '{loc}': {err.get('msg', 'invalid')} (got {err.get('input')!r})."
    return APIError(
        400, msg, param=loc or None, code="invalid_value" if kind != "missing" else "missing_required_parameter"
    )


class _Base(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Base):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Base):
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    frequency_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    repetition_penalty: float | None = Field(None, gt=0)
    user: str | None = None
    # vLLM's extra sampling parameters (and OpenAI's logit_bias): bounds past these in `SamplingParams`
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    stop_token_ids: list[int] | None = None
    best_of: int | None = Field(None, ge=1, le=16)


class ChatCompletionRequest(_Sampling):
    messages: list[Any]
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    n: int = Field(1, ge=1, le=16)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: str | dict | None = None
    functions: list[Any] | None = None  # legacy: mapped onto tools
    function_call: str | dict | None = None  # legacy: mapped onto tool_choice
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    reasoning: dict | None = None
    chat_template_kwargs: dict | None = None
    include_reasoning: bool = True
    response_format: dict | None = None
    # Structured outputs (vLLM's extra body; the guided_* names are its older aliases) and the reasoning budget.
    structured_outputs: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    thinking_token_budget: int | None = Field(None, ge=0, le=INT32_MAX)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1, le=INT32_MAX)
    n: int = Field(1, ge=1, le=16)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None


class ResponsesReasoning(_Base):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(_Base):
    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ResponsesReasoning | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict | None = None
    text: dict | None = None
    user: str | None = None
    thinking_token_budget: int | None = Field(None, ge=0, le=INT32_MAX)


class TokenizeRequest(_Base):
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool = False
    tools: list[Any] | None = None
    tool_choice: str | dict | None = None
    reasoning_effort: str | None = None


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[int]


STOP_FINISH = Literal["stop", "length", "tool_calls"]
