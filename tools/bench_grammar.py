"""Grammar engines on the o200k_harmony vocabulary (201k tokens): schema compile time and the host's time per
constrained token, for the JSON schemas of the structured-output tests.

llguidance is timed as the engine runs it (`structured.Constraint.accept`: consume the token; for a gated row also
fast-forward what the grammar forces and compute the packed mask of the next token) and its mask computation alone.
outlines-core, when it is
installed, is timed on the same token sequences (its index is built per schema; then a mask per token is a lookup).
xgrammar is not timed: it needs torch (`pip install xgrammar` pulls it, and its import fails without it).

    python -m tools.bench_grammar [--outlines] [--out docs/results/bench_grammar_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from gptoss_jax import structured
from gptoss_jax import tokenizer as tokenizer_lib
from gptoss_jax.structured import StructuredOutputsParams as SO

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "user": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 999},
                "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            },
            "required": ["id", "tags"],
            "additionalProperties": False,
        },
        "score": {"type": "number"},
        "ok": {"type": "boolean"},
    },
    "required": ["user", "score", "ok"],
    "additionalProperties": False,
}
ARRAYS = {
    "type": "object",
    "properties": {
        "points": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "label": {"type": "string"}},
                "required": ["x", "label"],
            },
        }
    },
    "required": ["points"],
}
SCHEMAS = {"person": PERSON, "nested": NESTED, "arrays": ARRAYS, "json_object": {"type": "object"}}


def llguidance_walk(enc, schema: dict, tokens: int, seed: int) -> dict:
    """A random walk through the answer under `schema` (steered to its end as the engine does near its limit), timing
    each `accept` (the engine's host work per answer token: consume it, and where the row stays gated, fast-forward
    and compute the next mask) and each mask computed on its own where `accept` kept the token without one."""
    t0 = time.perf_counter()
    so = SO(json=schema)
    grammar = structured.compile_grammar(so, enc)
    c = structured.Constraint(grammar, enc, 0, tokenizer_lib.VOCAB_SIZE, [1], 1 + tokens)
    compile_ms = (time.perf_counter() - t0) * 1e3
    rng = np.random.default_rng(seed)
    _, out = c.accept([10])  # no reasoning: the answer starts
    accept_us, mask_us = [], []
    scratch = np.zeros(structured.mask_words(tokenizer_lib.VOCAB_SIZE) + 1, np.int32)
    while c.phase == "answer":
        mask = c.mask
        if not c.gated:  # the last tokens were kept without a mask: compute this state's, as a rejection would
            t1 = time.perf_counter()
            c.matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
            mask_us.append((time.perf_counter() - t1) * 1e6)
            mask = scratch[: c.words]
        t = int(rng.choice(np.nonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))[0]))
        t1 = time.perf_counter()
        _, forced = c.accept([t])
        accept_us.append((time.perf_counter() - t1) * 1e6)
        out += [t] + forced
    return {"compile_ms": compile_ms, "accept_us": accept_us, "mask_us": mask_us, "tokens": out}


def outlines_walk(enc, schema: dict, answer_tokens: list[int], vocab) -> dict | None:
    """outlines-core on the same answer tokens: index build, then mask + advance per token."""
    import outlines_core as oc

    regex = oc.json_schema.build_regex_from_schema(json.dumps(schema), r"")
    t0 = time.perf_counter()
    guide = oc.Guide(oc.Index(regex, vocab))
    build_ms = (time.perf_counter() - t0) * 1e3
    mask = np.zeros(enc.n_vocab, np.int32)
    step_us = []
    for t in answer_tokens:
        t1 = time.perf_counter()
        guide.write_mask_into(mask.ctypes.data, mask.size, 4)
        try:
            guide.advance(t)
        except ValueError:  # a string llguidance allows and this regex does not (escapes): the walk ends here
            break
        step_us.append((time.perf_counter() - t1) * 1e6)
    return {"index_build_ms": build_ms, "mask_and_advance_us": step_us}


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"n": len(xs), "mean": statistics.fmean(xs), "p50": xs[len(xs) // 2], "p99": xs[int(0.99 * (len(xs) - 1))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64, help="answer tokens per walk (steered to its end by then)")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--outlines", action="store_true", help="also time outlines-core (if installed)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import llguidance

    enc = tokenizer_lib.load()
    t0 = time.perf_counter()
    structured.ll_tokenizer(enc)
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {platform.node()}",
        "llguidance": llguidance.__version__,
        "llguidance_tokenizer_s": time.perf_counter() - t0,
        "schemas": {},
    }
    vocab = None
    if args.outlines:
        import outlines_core as oc

        by_bytes: dict[bytes, list[int]] = {}
        for t in range(structured.FIRST_SPECIAL):
            by_bytes.setdefault(enc.decode_single_token_bytes(t), []).append(t)
        vocab = oc.Vocabulary(tokenizer_lib.RETURN, by_bytes)
        report["outlines_core"] = oc.__version__ if hasattr(oc, "__version__") else "installed"
    for name, schema in SCHEMAS.items():
        walks = [llguidance_walk(enc, schema, args.tokens, seed) for seed in range(args.seeds)]
        row = {
            "llguidance_compile_ms": _stats([w["compile_ms"] for w in walks]),
            "llguidance_accept_us": _stats([x for w in walks for x in w["accept_us"]]),
            "llguidance_mask_us": _stats([x for w in walks for x in w["mask_us"]]),
        }
        if vocab is not None and name != "json_object":
            header = len(enc.encode("<|channel|>final<|message|>", allowed_special="all"))
            o = outlines_walk(enc, schema, walks[0]["tokens"][header:-1], vocab)  # less the stop token
            row["outlines_index_build_ms"] = o["index_build_ms"]
            row["outlines_mask_and_advance_us"] = _stats(o["mask_and_advance_us"])
        report["schemas"][name] = row
        line = ", ".join(
            f"{k} {v['p50']:.0f} (p99 {v['p99']:.0f})" if isinstance(v, dict) else f"{k} {v:.0f}"
            for k, v in row.items()
        )
        print(f"{name}: {line}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
