"""Offline batch generation over JSONL: `python -m gptoss_jax.generate --input in.jsonl --output out.jsonl`.

Each input line is an object with `prompt` (text) or `prompt_token_ids`, an optional `id` (default:
the line number) and optional sampling fields (`max_tokens`, `temperature`, `top_p`, `top_k`,
`min_p`, `seed`, `stop`, `stop_token_ids`, `logprobs`). Results are appended to the output as each
request finishes (or, with `ordered`, in the input's order), so an interrupted job resumes where it stopped: ids
already in the output are skipped (a last line cut short is dropped first). A line that cannot run (bad JSON, an
unknown field, a prompt over the context) is written as `{"id", "error"}` and the job goes on; remove that line from
the output to run it again. A request that fails in the engine is logged, counted as failed and not written, so a
rerun tries it again. All requests go through one continuously batched `Engine`.
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
SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)} - {"n"}


@dataclasses.dataclass
class Line:
    """One input line: its request id and either the request or why it cannot run (`error`)."""

    id: str
    where: str  # file:line
    obj: dict | None = None
    error: str | None = None


def read_lines(path: str | Path) -> list[Line]:
    """Parse every line up front (no model needed). A bad line becomes an error entry, not a failed job; only
    duplicate ids stop the job, since the output (and resuming it) is keyed by id: they are all named."""
    path = Path(path)
    out = []
    for n, text in enumerate(path.read_text().splitlines(), 1):
        if not text.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            out.append(Line(str(n), where, error=f"{where}: invalid JSON ({e})"))
            continue
        if not isinstance(obj, dict):
            out.append(Line(str(n), where, error=f"{where}: expected a JSON object"))
            continue
        line = Line(str(obj.get("id", n)), where, obj)
        unknown = set(obj) - SAMPLING_FIELDS - {"id", "prompt", "prompt_token_ids"}
        if unknown:
            line.error = f"{where}: unknown field(s) {sorted(unknown)}" + (
                " (n > 1: repeat the line with other ids)" if "n" in unknown else ""
            )
        elif ("prompt" in obj) == ("prompt_token_ids" in obj):
            line.error = f"{where}: give exactly one of 'prompt' and 'prompt_token_ids'"
        out.append(line)
    seen: dict[str, list[str]] = {}
    for line in out:
        seen.setdefault(line.id, []).append(line.where.rsplit(":", 1)[1])
    dups = {rid: lines for rid, lines in seen.items() if len(lines) > 1}
    if dups:
        named = ", ".join(f"{rid!r} (lines {', '.join(lines)})" for rid, lines in list(dups.items())[:10])
        raise ValueError(f"{path}: {len(dups)} duplicate request id(s): {named}")
    return out


def _request(line: Line, engine: Engine, defaults: dict) -> tuple[list[int], SamplingParams]:
    """Token ids and sampling settings of a valid line (ValueError naming the line otherwise)."""
    obj = line.obj
    if "prompt" in obj:
        if engine.tokenizer is None:
            raise ValueError(f"{line.where}: this model has no tokenizer; use 'prompt_token_ids'")
        if not isinstance(obj["prompt"], str):
            raise ValueError(f"{line.where}: 'prompt' must be a string")
        ids = engine.tokenizer.encode(obj["prompt"], allowed_special="all")
    else:
        ids = obj["prompt_token_ids"]
        if not isinstance(ids, list) or any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
            raise ValueError(f"{line.where}: 'prompt_token_ids' must be a list of integers")
    try:
        return ids, SamplingParams(**{**defaults, **{k: v for k, v in obj.items() if k in SAMPLING_FIELDS}})
    except (TypeError, ValueError) as e:
        raise ValueError(f"{line.where}: {e}") from None


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


def run(
    engine: Engine,
    input_path: str | Path,
    output_path: str | Path,
    defaults: dict,
    progress: bool = True,
    ordered: bool = False,
) -> dict:
    """Generate every request of `input_path` not yet in `output_path`; returns a throughput summary. A line that
    cannot run is written as `{"id", "error"}` and the job goes on. `ordered` writes results in the input's order
    (each as soon as those before it are written) instead of as they finish."""
    output_path = Path(output_path)
    lines = read_lines(input_path)
    done = set()
    if output_path.exists():
        _drop_partial_line(output_path)
        for text in output_path.read_text().splitlines():
            try:
                done.add(str(json.loads(text)["id"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # not one of our records; its request (if any) runs again
    todo = [line for line in lines if line.id not in done]
    ready: dict[str, dict] = {}
    prompts = {}
    for line in todo:
        if line.error is None:
            try:
                ids, sp = _request(line, engine, defaults)
                engine.add_request(line.id, ids, sp)  # validates (context length, logprobs, stop strings)
                prompts[line.id] = (ids, sp)
                continue
            except ValueError as e:
                line.error = str(e) if str(e).startswith(line.where) else f"{line.where}: {e}"
        ready[line.id] = {"id": line.id, "error": line.error}
    order = [line.id for line in todo]
    tokens = {rid: [] for rid in prompts}
    logprobs = {rid: [] for rid in prompts}
    t0 = time.perf_counter()
    n_out, written, failed = 0, 0, []
    with open(output_path, "a") as f, tqdm(total=len(todo), desc="Requests", unit="req", disable=not progress) as bar:

        def flush() -> None:
            nonlocal written
            while True:
                if ordered:
                    if written == len(order) or order[written] not in ready:
                        return
                    record = ready.pop(order[written])
                elif ready:
                    record = ready.pop(next(iter(ready)))
                else:
                    return
                f.write(json.dumps(record) + "\n")
                f.flush()
                written += 1
                bar.update(1)

        flush()
        while engine.has_unfinished_requests():
            for o in engine.step():
                tokens[o.request_id] += o.new_token_ids
                logprobs[o.request_id] += o.logprobs or []
                if not o.finished:
                    continue
                ids, sp = prompts[o.request_id]
                toks = tokens.pop(o.request_id)
                n_out += len(toks)
                if o.finish_reason == "error":  # not written: a rerun tries it again
                    failed.append(o.request_id)
                    order.remove(o.request_id)
                    log.error("%s", o.error)
                    bar.update(1)
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
                ready[o.request_id] = record
            flush()
            bar.set_postfix(out_tok_s=f"{n_out / (time.perf_counter() - t0):.0f}")
    elapsed = time.perf_counter() - t0
    n_in = sum(len(ids) for ids, _ in prompts.values())
    return {
        "requests": len(prompts),
        "errors": len(todo) - len(prompts),
        "failed": len(failed),
        "skipped": len(lines) - len(todo),
        "input_tokens": n_in,
        "output_tokens": n_out,
        "seconds": round(elapsed, 3),
        "output_tokens_per_s": round(n_out / elapsed, 1) if elapsed > 0 else None,
        "total_tokens_per_s": round((n_in + n_out) / elapsed, 1) if elapsed > 0 else None,
    }
