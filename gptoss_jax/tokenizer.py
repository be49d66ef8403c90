"""The o200k_harmony tokenizer (o200k_base ranks + harmony special tokens), loaded offline-first.

The rank file is looked up, in order, at an explicit path, in the checkpoint folder, under
`TIKTOKEN_ENCODINGS_BASE`, in `$GPTOSS_JAX_HOME/tokenizer`, and finally through tiktoken's own download (kept in
`$GPTOSS_JAX_HOME/tokenizer`, where openai-harmony can read it too). A missing file fails at start-up with the
lookup order, never on the first request.
"""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import tiktoken
from tiktoken.load import load_tiktoken_bpe, read_file_cached
from tiktoken_ext import openai_public

RANK_FILE = "o200k_base.tiktoken"
RANK_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
VOCAB_SIZE = 201088
# Special tokens the engine and server refer to by name.
RETURN, CONSTRAIN, CHANNEL, START, END, MESSAGE, CALL = 200002, 200003, 200005, 200006, 200007, 200008, 200012
ENDOFTEXT = 199999
ASSISTANT_STOPS = (RETURN, CALL)


class TokenizerError(RuntimeError):
    """The vocabulary file cannot be found or does not match its hash."""


RANK_URL = "https://openaipublic.blob.core.windows.net/encodings/" + RANK_FILE
LOOKUP_ORDER = (
    "--tokenizer PATH (tokenizer=...), the checkpoint folder (or its original/), $TIKTOKEN_ENCODINGS_BASE, "
    "a copy downloaded earlier into $GPTOSS_JAX_HOME/tokenizer, then tiktoken's download (kept there)"
)


def downloaded_copy() -> Path:
    """Where a downloaded rank file is kept (beside the demo checkpoint: `runtime.home()`)."""
    from gptoss_jax import runtime

    return runtime.home() / "tokenizer" / RANK_FILE


def _candidates(path: str | Path | None, checkpoint: str | Path | None) -> list[Path]:
    out = []
    if path is not None:
        p = Path(path)
        out.append(p / RANK_FILE if p.is_dir() else p)
    if checkpoint is not None:
        out += [Path(checkpoint) / RANK_FILE, Path(checkpoint) / "original" / RANK_FILE]
    if os.environ.get("TIKTOKEN_ENCODINGS_BASE"):
        out.append(Path(os.environ["TIKTOKEN_ENCODINGS_BASE"]) / RANK_FILE)
    out.append(downloaded_copy())
    return out


def rank_file(path: str | Path | None = None, checkpoint: str | Path | None = None) -> Path:
    """The local `o200k_base.tiktoken`: the first found in `LOOKUP_ORDER`, else downloaded by tiktoken (hash
    checked) into `$GPTOSS_JAX_HOME/tokenizer`. An explicit `path` that does not exist is an error of its own."""
    tried = _candidates(path, checkpoint)
    if path is not None and not tried[0].exists():
        raise TokenizerError(f"tokenizer rank file {tried[0]} not found (--tokenizer / tokenizer=)")
    found = next((p for p in tried if p.is_file()), None)
    if found is not None:
        return found
    try:
        data = read_file_cached(RANK_URL, RANK_SHA256)
    except Exception as e:
        raise TokenizerError(
            f"cannot find the o200k_harmony vocabulary {RANK_FILE} (sha256 {RANK_SHA256[:12]}...). Looked, in "
            f"order, at {[str(p) for p in tried]}, then the download from {RANK_URL} failed "
            f"({type(e).__name__}: {e}). Lookup order: {LOOKUP_ORDER}. Offline, give the file with --tokenizer "
            "PATH, put it in the checkpoint folder, or set TIKTOKEN_ENCODINGS_BASE to the folder holding it."
        ) from None
    target = downloaded_copy()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(target)
    return target


def load(path: str | Path | None = None, checkpoint: str | Path | None = None) -> tiktoken.Encoding:
    """Build the o200k_harmony `tiktoken.Encoding` from `rank_file(path, checkpoint)`."""
    source = rank_file(path, checkpoint)
    try:
        ranks = load_tiktoken_bpe(str(source), expected_hash=RANK_SHA256)
    except ValueError as e:  # hash mismatch
        raise TokenizerError(f"{source}: {e}") from None
    # tiktoken defines o200k_harmony's pattern and specials; only the rank source is ours.
    with mock.patch.object(openai_public, "load_tiktoken_bpe", lambda *a, **k: ranks):
        spec = openai_public.o200k_harmony()
    return tiktoken.Encoding(
        spec["name"],
        pat_str=spec["pat_str"],
        mergeable_ranks=spec["mergeable_ranks"],
        special_tokens=spec["special_tokens"],
    )
