"""Load generator for any OpenAI-compatible server (this one, vLLM, SGLang, TRT-LLM, ...).

    python -m tools.bench_serving --base-url http://127.0.0.1:8000 --num-prompts 200 --concurrency 32 \
        --input-len 1024 --output-len 256 [--request-rate 8] [--endpoint chat|completions] [--json out.json]

Sends streamed requests with synthetic prompts of about `--input-len` tokens, at most `--concurrency`
in flight, arriving as a Poisson process at `--request-rate` per second (default: all at once).
Reports request and token throughput and TTFT / TPOT / ITL / end-to-end percentiles (p50, p90, p99).
Token counts come from the server's usage (stream_options.include_usage); servers that omit it are
counted by streamed chunks. Only httpx is needed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import httpx

WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government number "
    "night point home water room mother area money story fact month lot right study book eye job word"
).split()


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    s = sorted(xs)

    def q(p):
        k = (len(s) - 1) * p
        lo, hi = int(k), min(int(k) + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return {"mean": sum(s) / len(s), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


def make_prompt(rng: random.Random, n_tokens: int) -> str:
    # ~1 token per common English word with a leading space.
    return "Repeat and continue: " + " ".join(rng.choice(WORDS) for _ in range(max(1, n_tokens - 8)))


async def sse_lines(chunks):
    """The lines of a server-sent-events body as the spec splits them: at CRLF, LF or CR only. (httpx's
    `aiter_lines` also splits at U+2028, U+2029 and U+0085, which generated text may hold inside one `data:` line.)"""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        *lines, buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        for line in lines:
            yield line.decode("utf-8")
    if buf:
        yield buf.decode("utf-8")


async def one_request(client: httpx.AsyncClient, args, prompt: str, out_len: int) -> dict:
    chat = args.endpoint == "chat"
    body: dict = {
        "model": args.model,
        "max_tokens": out_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": args.temperature,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if args.extra_body:
        body.update(json.loads(args.extra_body))
    path = "/v1/chat/completions" if chat else "/v1/completions"
    rec = {"ok": False, "ttft": None, "itl": [], "e2e": None, "output_tokens": 0, "prompt_tokens": None, "error": None}
    t0 = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return rec
            async for line in sse_lines(r.aiter_bytes()):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("usage"):
                    rec["output_tokens"] = msg["usage"].get("completion_tokens", 0)
                    rec["prompt_tokens"] = msg["usage"].get("prompt_tokens")
                got = False
                for ch in msg.get("choices") or []:
                    d = ch.get("delta") or {}
                    if (
                        d.get("content")
                        or d.get("reasoning_content")
                        or d.get("reasoning")
                        or d.get("tool_calls")
                        or ch.get("text")
                    ):
                        got = True
                if got:
                    now = time.perf_counter()
                    if last is None:
                        rec["ttft"] = now - t0
                    else:
                        rec["itl"].append(now - last)
                    last = now
                    chunks += 1
        rec["e2e"] = time.perf_counter() - t0
        if not rec["output_tokens"]:
            rec["output_tokens"] = chunks
        rec["ok"] = rec["ttft"] is not None
        if not rec["ok"]:
            rec["error"] = "no output"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    return rec


async def run(args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    async with httpx.AsyncClient(
        base_url=args.base_url, headers=headers, timeout=args.timeout, limits=limits
    ) as client:
        if not args.model:
            r = await client.get("/v1/models")
            r.raise_for_status()
            args.model = r.json()["data"][0]["id"]
        rng = random.Random(args.seed)
        prompts = [make_prompt(rng, args.input_len) for _ in range(args.num_prompts)]
        out_lens = [
            max(1, int(args.output_len * rng.uniform(1 - args.range_ratio, 1 + args.range_ratio)))
            for _ in range(args.num_prompts)
        ]
        sem = asyncio.Semaphore(args.concurrency)

        async def limited(p, n):
            async with sem:
                return await one_request(client, args, p, n)

        if args.warmup:
            await one_request(client, args, prompts[0], 4)
        t0 = time.perf_counter()
        tasks = []
        for p, n in zip(prompts, out_lens):
            tasks.append(asyncio.create_task(limited(p, n)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        recs = await asyncio.gather(*tasks)
        dur = time.perf_counter() - t0
    ok = [r for r in recs if r["ok"]]
    out_tok = sum(r["output_tokens"] for r in ok)
    in_tok = sum(r["prompt_tokens"] or 0 for r in ok)
    tpot = [(r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1]
    return {
        "model": args.model,
        "endpoint": args.endpoint,
        "num_prompts": args.num_prompts,
        "concurrency": args.concurrency,
        "request_rate": args.request_rate,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "completed": len(ok),
        "failed": len(recs) - len(ok),
        "errors": sorted({r["error"] for r in recs if r["error"]})[:5],
        "duration_s": dur,
        "request_throughput": len(ok) / dur,
        "output_token_throughput": out_tok / dur,
        "total_token_throughput": (in_tok + out_tok) / dur,
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "ttft_s": percentiles([r["ttft"] for r in ok]),
        "tpot_s": percentiles(tpot),
        "itl_s": percentiles([x for r in ok for x in r["itl"]]),
        "e2e_s": percentiles([r["e2e"] for r in ok]),
    }


def report(res: dict) -> str:
    lines = [
        f"model {res['model']}  endpoint {res['endpoint']}  prompts {res['num_prompts']}  concurrency "
        f"{res['concurrency']}  rate {res['request_rate']}/s  in {res['input_len']}  out {res['output_len']}",
        f"completed {res['completed']}  failed {res['failed']}  duration {res['duration_s']:.2f}s",
        f"requests/s {res['request_throughput']:.2f}  output tok/s {res['output_token_throughput']:.1f}  "
        f"total tok/s {res['total_token_throughput']:.1f}",
    ]
    for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        p = res[name]
        if p["p50"] is None:
            lines.append(f"{name[:-2].upper():5} n/a")
            continue
        lines.append(
            f"{name[:-2].upper():5} ms  mean {p['mean'] * 1e3:9.2f}  p50 {p['p50'] * 1e3:9.2f}  "
            f"p90 {p['p90'] * 1e3:9.2f}  p99 {p['p99'] * 1e3:9.2f}"
        )
    for e in res["errors"]:
        lines.append(f"error: {e}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); default: all at once"
    )
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0, help="output lengths uniform in len*(1±ratio)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--extra-body", default=None, help="JSON merged into every request, e.g. '{\"ignore_eos\": true}'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    res = asyncio.run(run(args))
    print(report(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if res["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
