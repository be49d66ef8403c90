"""Test-only engine with the `Engine` interface whose "model" replays scripted harmony token sequences.

The tiny random model cannot produce valid harmony, so the server's output path (parser, streaming,
tool calls, stop strings, usage, logprobs) is tested end to end with this engine behind the real
HTTP server: `python -m gptoss_jax.serve --test-engine tests/scripted_engine.py:make_engine`.

The script is chosen by a marker in the prompt text: `[[script:NAME]]` (see SCRIPTS) or
`[[count:N]]` (a final answer " t0 t1 ... tN-1") or `[[echo:params]]` (a final answer that is the request's logits
processor settings as JSON, so tests see what reached the engine). Steps emit 1, 2 or 3 tokens in turn, so multi-token
deliveries are exercised. Faults as `Engine` reports them: `[[fault:request]]` ends that request with finish reason
"error" after a few tokens; `[[fault:step]]` makes one `step()` raise (a fault the engine cannot pin on a request).
KV "pages" (16 tokens each) are tracked so /metrics shows them freed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time

from gptoss_jax import tokenizer as tokenizer_lib

PAGE = 16
ECHOED = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "bad_words",
    "allowed_token_ids",
    "stop_token_ids",
    "n",
    "logprobs",
)
NUM_PAGES = 4096

SCRIPTS = {
    "default": "<|channel|>final<|message|>Hello from the scripted engine.<|return|>",
    "reasoning": "<|channel|>analysis<|message|>The user asks 2+2. That is 4.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>The answer is 4.<|return|>",
    "tool": "<|channel|>analysis<|message|>Need the weather tool for Paris.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"location": "Paris", "unit": "celsius"}<|call|>',
    "preamble_tool": "<|channel|>analysis<|message|>Plan: tell the user, then call.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Let me check the weather.<|end|>"
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
    '{"location": "Tokyo"}<|call|>',
    "after_tool": "<|channel|>analysis<|message|>Tool said sunny.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris, 21 °C.<|return|>",
    "unicode": "<|channel|>analysis<|message|>Ünïcödé thoughts 思考 🤔<|end|>"
    "<|start|>assistant<|channel|>final<|message|>héllo 世界 🌍🎉 naïve café<|return|>",
    "malformed": "<|channel|>analysis<|message|>hmm<|end|>stray text<|start|>assistant<|channel|>final"
    "<|message|>ok<|constrain|>!<|reserved_200013|><|return|>",
    "headerless": "I cannot help with that.<|return|>",
    "length": "<|channel|>analysis<|message|>" + "thinking " * 200 + "<|end|>",
    "separators": "<|channel|>final<|message|>line\u2028para\u2029next\u0085end \u2028\u2029<|return|>",
    "stopword": "<|channel|>analysis<|message|>STOP in reasoning is fine<|end|>"
    "<|start|>assistant<|channel|>final<|message|>one two STOP three four<|return|>",
}


@dataclasses.dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | None = None
    logprobs: list | None = None
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    error: str | None = None


@dataclasses.dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_compiles: int = 0


@dataclasses.dataclass
class _Req:
    rid: str
    prompt_len: int
    script: list[int]
    params: object
    pos: int = 0
    generated: int = 0
    steps: int = 0
    slow: bool = False
    fault: str | None = None


class ScriptedEngine:
    def __init__(self, max_model_len: int = 4096, step_sleep: float = 0.0):
        self.tokenizer = tokenizer_lib.load()
        self.max_model_len = max_model_len
        self.model_config = None
        self.step_sleep = step_sleep
        self.reqs: dict[str, _Req] = {}
        self.stats_ = EngineStats()

    def _script(self, prompt: list[int]) -> tuple[list[int], bool]:
        text = self.tokenizer.decode(prompt)
        # The last marker wins: in multi-turn tests the latest user message picks the script.
        marks = re.findall(r"\[\[(script|count|slow|fault):([A-Za-z_0-9]+)\]\]", text)
        kind, arg = marks[-1] if marks else ("script", "default")
        if kind == "fault":
            return self.tokenizer.encode("<|channel|>final<|message|>", allowed_special="all"), True
        if kind == "count":
            body = "".join(f" t{i}" for i in range(int(arg)))
            return self.tokenizer.encode(f"<|channel|>final<|message|>{body}<|return|>", allowed_special="all"), False
        if kind == "slow":
            return self.tokenizer.encode("<|channel|>final<|message|>", allowed_special="all"), True
        return self.tokenizer.encode(SCRIPTS[arg], allowed_special="all"), False

    def add_request(self, request_id, prompt_token_ids, sampling_params) -> None:
        if request_id in self.reqs:
            raise ValueError(f"duplicate request id {request_id}")
        if not prompt_token_ids:
            raise ValueError("empty prompt")
        if len(prompt_token_ids) + sampling_params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_token_ids)} tokens + max_tokens {sampling_params.max_tokens} "
                f"exceeds max_model_len {self.max_model_len}"
            )
        script, slow = self._script(list(prompt_token_ids))
        if "[[echo:params]]" in self.tokenizer.decode(list(prompt_token_ids)):
            p = sampling_params
            echo = {
                name: getattr(p, name)
                for name in ECHOED
                if getattr(p, name) not in (None, 0, 0.0, False)
                and not (name == "repetition_penalty" and p.repetition_penalty == 1)
            }
            echo["logit_bias"] = {str(k): v for k, v in (p.logit_bias or {}).items()} or None
            text = "<|channel|>final<|message|>" + json.dumps(echo) + "<|return|>"
            script = self.tokenizer.encode(text, allowed_special="all")
        fault = re.findall(r"\[\[fault:(request|step)\]\]", self.tokenizer.decode(list(prompt_token_ids)))
        self.reqs[request_id] = _Req(
            request_id, len(prompt_token_ids), script, sampling_params, slow=slow, fault=fault[-1] if fault else None
        )
        self.stats_.prompt_tokens_total += len(prompt_token_ids)

    def abort_request(self, request_id) -> None:
        self.reqs.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def _token(self, r: _Req) -> int:
        if r.pos < len(r.script):
            return r.script[r.pos]
        if r.slow:
            return 1234  # " same" filler text forever
        return tokenizer_lib.ENDOFTEXT

    def step(self) -> list[StepOutput]:
        if self.step_sleep:
            time.sleep(self.step_sleep)
        outs = []
        for rid, r in list(self.reqs.items()):
            if r.fault and r.steps == 3:
                del self.reqs[rid]
                if r.fault == "step":
                    raise RuntimeError("injected step fault")
                outs.append(StepOutput(rid, [], True, "error", None, None, r.prompt_len, 0, f"request {rid}: injected"))
                continue
            r.steps += 1
            k = 1 + (r.steps % 3)
            toks: list[int] = []
            finish, stop = None, None
            want_lp = getattr(r.params, "logprobs", None)
            for _ in range(k):
                t = self._token(r)
                r.pos += 1
                if t in r.params.stop_token_ids:
                    finish, stop = "stop", t
                    break
                toks.append(t)
                r.generated += 1
                if r.generated >= r.params.max_tokens:
                    finish = "length"
                    break
            lps = None
            if want_lp is not None:
                lps = [(-0.5, [(t, -0.5), (t + 1, -1.5), (t + 2, -2.5)][: max(want_lp, 0)]) for t in toks]
            self.stats_.generation_tokens_total += len(toks)
            outs.append(StepOutput(rid, toks, finish is not None, finish, stop, lps, r.prompt_len, 0))
            if finish is not None:
                del self.reqs[rid]
        return outs

    def stats(self) -> EngineStats:
        s = self.stats_
        s.num_running = len(self.reqs)
        used = sum(math.ceil((r.prompt_len + r.generated) / PAGE) for r in self.reqs.values())
        s.kv_cache_usage = used / NUM_PAGES
        return dataclasses.replace(s)


def make_engine(args, on_progress=None) -> ScriptedEngine:
    return ScriptedEngine(max_model_len=4096, step_sleep=0.002)


def make_slow_engine(args, on_progress) -> ScriptedEngine:
    """Loads in ~3 s, reporting its warm-up program by program as `Engine` does."""
    on_progress("loading weights", 1, 1, "0.1s")
    for i in range(1, 7):
        time.sleep(0.5)
        on_progress("compiling", i, 6, f"decode rows={i} ctx=1024 {0.5 * i:.1f}s")
    return make_engine(args)
