"""Offline batch generation over JSONL: `python -m gptoss_jax.generate --input in.jsonl --output out.jsonl`.

Each input line is an object with `prompt` (text) or `prompt_token_ids`, an optional `id` (default:
the line number) and optional sampling fields (`max_tokens`, `temperature`, `top_p`, `top_k`,
`min_p`, `seed`, `stop`, `stop_token_ids`, `logprobs`). Results are appended to the output as each
request finishes, so an interrupted job resumes where it stopped: ids already in the output are
skipped (a last line cut short is dropped first); a request that fails in the engine is logged, counted as failed and
not written, so a rerun tries it again. All requests go through one continuously batched `Engine`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

from tqdm.auto import tqdm

from gptoss_jax.engine import Engine
from gptoss_jax.sampling import SamplingParams, find_stop_string

log = logging.getLogger(__name__)
SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def read_requests(path: Path, engine: Engine, defaults: dict) -> list[tuple[str, list[int], SamplingParams]]:
    """Parse and validate every line up front, so a bad line fails before any compute."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: invalid JSON ({e})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object")
        unknown = set(obj) - SAMPLING_FIELDS - {"id", "prompt", "prompt_token_ids"}
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}")
        if ("prompt" in obj) == ("prompt_token_ids" in obj):
            raise ValueError(f"{where}: give exactly one of 'prompt' and 'prompt_token_ids'")
        if "prompt" in obj:
            if engine.tokenizer is None:
                raise ValueError(f"{where}: this model has no tokenizer; use 'prompt_token_ids'")
            ids = engine.tokenizer.encode(obj["prompt"], allowed_special="all")
        else:
            ids = obj["prompt_token_ids"]
        try:
            sp = SamplingParams(**{**defaults, **{k: v for k, v in obj.items() if k in SAMPLING_FIELDS}})
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None
        out.append((str(obj.get("id", n)), ids, sp))
    ids = [r[0] for r in out]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: duplicate request ids")
    return out


def _drop_partial_line(path: Path) -> None:
    """Cut a last line without its newline (a write cut short by a crash or a full disk), so the records appended
    next start on a line of their own; that line's request runs again."""
    with open(path, "rb+") as f:
        f.seek(0, 2)
        size = f.tell()
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        pos = size
        while pos > 0:  # back to the last newline, a block at a time
            start = max(0, pos - 65536)
            f.seek(start)
            cut = f.read(pos - start).rfind(b"\n")
            if cut >= 0:
                f.truncate(start + cut + 1)
                return
            pos = start
        f.truncate(0)


def run(engine: Engine, input_path: str | Path, output_path: str | Path, defaults: dict, progress: bool = True) -> dict:
    """Generate every request of `input_path` not yet in `output_path`; returns a throughput summary."""
    output_path = Path(output_path)
    requests = read_requests(Path(input_path), engine, defaults)
    done = set()
    if output_path.exists():
        _drop_partial_line(output_path)
        for line in output_path.read_text().splitlines():
            try:
                done.add(str(json.loads(line)["id"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # not one of our records; its request (if any) runs again
    todo = [r for r in requests if r[0] not in done]
    prompts = {}
    for rid, ids, sp in todo:
        engine.add_request(rid, ids, sp)  # validates (context length, logprobs, stop strings)
        prompts[rid] = (ids, sp)
    tokens = {rid: [] for rid in prompts}
    logprobs = {rid: [] for rid in prompts}
    t0 = time.perf_counter()
    n_out, failed = 0, []
    with open(output_path, "a") as f, tqdm(total=len(todo), desc="Requests", unit="req", disable=not progress) as bar:
        while engine.has_unfinished_requests():
            for o in engine.step():
                tokens[o.request_id] += o.new_token_ids
                logprobs[o.request_id] += o.logprobs or []
                if not o.finished:
                    continue
                ids, sp = prompts[o.request_id]
                toks = tokens.pop(o.request_id)
                n_out += len(toks)
                bar.update(1)
                if o.finish_reason == "error":  # not written: a rerun tries it again
                    failed.append(o.request_id)
                    log.error("%s", o.error)
                    continue
                record = {
                    "id": o.request_id,
                    "token_ids": toks,
                    "finish_reason": o.finish_reason,
                    "stop_reason": o.stop_reason,
                    "num_prompt_tokens": len(ids),
                    "num_cached_prompt_tokens": o.num_cached_prompt_tokens,
                }
                if engine.tokenizer is not None:
                    text = engine.tokenizer.decode(toks)
                    if isinstance(o.stop_reason, str):
                        text = text[: find_stop_string(text, (o.stop_reason,))[0]]
                    record["text"] = text
                if sp.logprobs is not None:
                    record["logprobs"] = logprobs[o.request_id]
                f.write(json.dumps(record) + "\n")
                f.flush()
                bar.set_postfix(out_tok_s=f"{n_out / (time.perf_counter() - t0):.0f}")
    elapsed = time.perf_counter() - t0
    n_in = sum(len(ids) for ids, _ in prompts.values())
    return {
        "requests": len(todo),
        "skipped": len(requests) - len(todo),
        "failed": len(failed),
        "input_tokens": n_in,
        "output_tokens": n_out,
        "seconds": round(elapsed, 3),
        "output_tokens_per_s": round(n_out / elapsed, 1) if elapsed > 0 else None,
        "total_tokens_per_s": round((n_in + n_out) / elapsed, 1) if elapsed > 0 else None,
    }
