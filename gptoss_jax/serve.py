"""OpenAI-compatible server: `python -m gptoss_jax.serve --model DIR [--config configs/X.yaml] [--port 8000]`.

Without `--model` it serves the built-in demo checkpoint. Endpoints: POST /v1/chat/completions,
/v1/completions, /v1/responses; GET /v1/models, /health (200 once loaded and warmed up), /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import logging
import os
import re
import sys
from pathlib import Path

from gptoss_jax import runtime
from pallas_kernels.kv_quant import DTYPES as KV_CACHE_DTYPES
from sharding import distributed

log = logging.getLogger("gptoss_jax.serve")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gptoss_jax.serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint folder (HF or original layout); default: the built-in demo")
    p.add_argument("--config", help="engine config (configs/*.yaml): batch sizes, KV pages, max_model_len")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("GPTOSS_JAX_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $GPTOSS_JAX_API_KEY)",
    )
    p.add_argument("--served-model-name", help="model id in the API (default: the checkpoint folder's name)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument(
        "--kv-cache-dtype",
        choices=sorted(KV_CACHE_DTYPES),
        default=None,
        help="KV cache: 'auto' (the model's dtype) or 'fp8' (e4m3, half the bytes; default: the config's, auto)",
    )
    p.add_argument(
        "--compile-cache-dir",
        default=None,
        help="where compiled steps persist across restarts ('off' for none; default $GPTOSS_JAX_COMPILE_CACHE, "
        "else $GPTOSS_JAX_HOME/compile-cache, $GPTOSS_JAX_HOME defaulting to ~/.cache/gptoss_jax)",
    )
    p.add_argument("--tokenizer", help="path to o200k_base.tiktoken (or its folder)")
    p.add_argument(
        "--impl",
        choices=["pallas", "reference"],
        default=None,
        help="kernels or the pure-JAX reference path (default: kernels on GPU, reference elsewhere)",
    )
    p.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024, help="largest accepted request body")
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=None,
        help="cap on max_tokens when a request gives none (default: the rest of the context)",
    )
    p.add_argument(
        "--conversation-start-date",
        default=None,
        help="render 'Current date: YYYY-MM-DD' in the system message (off by default: stable prefixes)",
    )
    p.add_argument("--model-identity", default=None, help="replace the system message's identity line")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up requests before /health is 200")
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds running requests may take to finish before each is ended with an error "
        "(default 30)",
    )
    p.add_argument("--log-level", default="info")
    # Test-only: load an engine from FILE.py:FACTORY instead of gptoss_jax.engine (scripted outputs).
    p.add_argument("--test-engine", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.shutdown_timeout < 0:
        p.error("--shutdown-timeout must be >= 0")
    if args.conversation_start_date and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", args.conversation_start_date):
        p.error("--conversation-start-date must be YYYY-MM-DD")
    return args


def _engine_factory(args, model_path: Path):
    if args.test_engine:
        file, _, name = args.test_engine.rpartition(":")
        spec = importlib.util.spec_from_file_location("gptoss_test_engine", file)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return lambda on_progress: getattr(mod, name)(args, on_progress)

    def build(on_progress):
        from gptoss_jax.engine import Engine

        kw = {"dtype": args.dtype, "impl": args.impl, "compile_cache_dir": args.compile_cache_dir}
        if args.config:
            kw["config"] = args.config
        if args.tokenizer:
            kw["tokenizer"] = args.tokenizer
        if args.kv_cache_dtype:
            kw["kv_cache_dtype"] = args.kv_cache_dtype
        return Engine(str(model_path), progress=False, on_progress=on_progress, **kw)

    return build


def _warmup_requests(st):
    """One short greedy chat request: compiles the prefill and decode steps the first user would hit
    (sampling settings and logprobs are runtime inputs of the same programs)."""
    from gptoss_jax.server.app import _sampling_params

    prompt = st.renderer.render_chat([{"role": "user", "content": "Hello!"}], [], "low")
    p = _sampling_params(temperature=0.0, top_p=None, top_k=None, min_p=None, seed=None, max_tokens=4, logprobs=None)
    return [prompt], [p]


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    runtime.prepare(args.compile_cache_dir)
    distributed.initialize()  # joins a multi-host job when GPTOSS_COORDINATOR etc. are set; else a no-op
    import uvicorn

    from gptoss_jax import demo, harmony
    from gptoss_jax import tokenizer as tokenizer_lib
    from gptoss_jax.async_engine import AsyncEngine
    from gptoss_jax.server.app import ServerConfig, State, build_app
    from gptoss_jax.server.http import DrainingServer, HeaderTimeoutProtocol

    model_path = Path(args.model) if args.model else demo.checkpoint_path()
    name = args.served_model_name or (model_path.name if args.model else "gpt-oss-demo")
    # The vocabulary is needed twice (harmony rendering, our parser): load both now and fail loudly.
    try:
        harmony.load_encoding()
        tok = tokenizer_lib.load(args.tokenizer, model_path)
    except Exception as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    engine = AsyncEngine(_engine_factory(args, model_path))
    st = State(
        engine,
        tok,
        ServerConfig(
            model_name=name,
            api_key=args.api_key,
            max_body_bytes=args.max_body_bytes,
            conversation_start_date=args.conversation_start_date,
            model_identity=args.model_identity,
            default_max_tokens=args.default_max_tokens,
        ),
    )
    server_box: dict = {}

    async def prepare():
        try:
            await engine.wait_loaded()
            if not args.no_warmup:
                engine.report("warm-up request", 0, 1)
                prompts, params = _warmup_requests(st)
                dt = await engine.warmup(prompts, params)
                log.info("warm-up request done in %.1fs", dt)
            st.ready = True
            log.info("ready: serving %s on http://%s:%d", name, args.host, args.port)
        except Exception:
            log.exception("start-up failed")
            server_box["failed"] = True
            server_box["server"].should_exit = True

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        task = asyncio.create_task(prepare())
        try:
            yield
        finally:
            task.cancel()
            await asyncio.to_thread(engine.shutdown)

    app = build_app(st, lifespan=lifespan)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        http=HeaderTimeoutProtocol,
        # The drain (`DrainingServer`) ends requests at --shutdown-timeout; uvicorn cancels what is left a bit later.
        timeout_graceful_shutdown=args.shutdown_timeout + DrainingServer.grace_s,
    )
    server = DrainingServer(config, st, args.shutdown_timeout)
    server_box["server"] = server
    server.run()
    return 1 if server_box.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
