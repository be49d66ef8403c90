"""OpenAI-compatible server: `python -m gptoss_jax.serve --model DIR|ORG/NAME [--config PROFILE] [--port 8000]`.

Without `--model` it serves the built-in demo checkpoint. Flags are named as vLLM's (docs/server.md). Endpoints:
POST /v1/chat/completions, /v1/completions, /v1/responses; GET /v1/models, /health (200 once loaded and warmed up),
/metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import re
import sys
import time
from pathlib import Path

from gptoss_jax import cli, runtime
from sharding import distributed

log = logging.getLogger("gptoss_jax.serve")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=cli.prog("gptoss-serve", "gptoss_jax.serve"),
        description=__doc__.splitlines()[0],
        formatter_class=cli.Formatter,
    )
    cli.add_model_args(p)
    cli.add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 for all)")
    g.add_argument("--port", type=int, default=8000, help="TCP port")
    g.add_argument(
        "--api-key",
        default=os.environ.get("GPTOSS_JAX_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $GPTOSS_JAX_API_KEY)",
    )
    g.add_argument("--served-model-name", help="model id in the API (default: the repo id, or the folder's name)")
    g.add_argument("--root-path", default="", help="path prefix when behind a proxy that strips it (ASGI root_path)")
    g.add_argument("--ssl-keyfile", help="serve HTTPS with this private key (with --ssl-certfile)")
    g.add_argument("--ssl-certfile", help="serve HTTPS with this certificate (with --ssl-keyfile)")
    g.add_argument(
        "--allowed-origins",
        type=_origins,
        default=[],
        help="CORS: origins browsers may call from, as a JSON list or comma-separated ('*' for any; none: CORS off)",
    )
    g.add_argument("--allowed-methods", type=_origins, default=["*"], help="CORS: allowed methods")
    g.add_argument("--allowed-headers", type=_origins, default=["*"], help="CORS: allowed request headers")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    g.add_argument("--enable-log-requests", action="store_true", help="log every request: method, path, status, time")
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="no uvicorn access log lines")
    g.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024, help="largest accepted request body")
    g.add_argument(
        "--default-max-tokens",
        type=int,
        default=None,
        help="cap on max_tokens when a request gives none (default: the rest of the context)",
    )
    g.add_argument(
        "--conversation-start-date",
        default=None,
        help="render 'Current date: YYYY-MM-DD' in the system message (default: off, so prefixes stay stable)",
    )
    g.add_argument("--model-identity", default=None, help="replace the system message's identity line")
    g.add_argument(
        "--max-stored-responses",
        type=int,
        default=1000,
        help="Responses API: how many stored responses (store=true) are kept in memory, least recently used evicted "
        "first (0: none)",
    )
    g.add_argument("--no-warmup", action="store_true", help="skip the warm-up requests before /health is 200")
    g.add_argument(
        "--log-level", "--uvicorn-log-level", dest="log_level", default="info", help="debug, info, warning, error"
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds running requests may take to finish before each is ended with an error",
    )
    # Test-only: load an engine from FILE.py:FACTORY instead of gptoss_jax.engine (scripted outputs).
    p.add_argument("--test-engine", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.shutdown_timeout < 0:
        p.error("--shutdown-timeout must be >= 0")
    if args.max_stored_responses < 0:
        p.error("--max-stored-responses must be >= 0")
    if args.conversation_start_date and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", args.conversation_start_date):
        p.error("--conversation-start-date must be YYYY-MM-DD")
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        p.error("--ssl-keyfile and --ssl-certfile go together")
    return args


def _origins(text: str) -> list[str]:
    """A JSON list (vLLM's form) or comma-separated values."""
    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return value
    return [v.strip() for v in text.split(",") if v.strip()]


class _RequestLog:
    """ASGI middleware: one log line per HTTP request (method, path, status, milliseconds)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), []

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            log.info(
                "request %s %s -> %s in %.1f ms",
                scope["method"],
                scope["path"],
                status[0] if status else "-",
                1e3 * (time.perf_counter() - t0),
            )


def _engine_factory(args, model_path: Path, engine_config):
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
        if args.tokenizer:
            kw["tokenizer"] = args.tokenizer
        if args.seed is not None:
            kw["seed"] = args.seed
        return Engine(str(model_path), config=engine_config, progress=False, on_progress=on_progress, **kw)

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
    runtime.prepare(args.compile_cache_dir, args.gpu_memory_utilization)
    distributed.initialize()  # joins a multi-host job when GPTOSS_COORDINATOR etc. are set; else a no-op
    import uvicorn

    from gptoss_jax import harmony
    from gptoss_jax import tokenizer as tokenizer_lib
    from gptoss_jax.async_engine import AsyncEngine
    from gptoss_jax.server.app import ServerConfig, State, build_app
    from gptoss_jax.server.http import DrainingServer, HeaderTimeoutProtocol

    # Everything a user can get wrong fails here, in one line, before the server starts listening: the model (a
    # repo id is downloaded now), the profile and flags, and the vocabulary (needed twice: harmony rendering and
    # our parser, both from the one file the lookup finds).
    try:
        model_path, ec = cli.resolve(args)
        rank_file = tokenizer_lib.rank_file(args.tokenizer, model_path)
        harmony.load_encoding(rank_file)
        tok = tokenizer_lib.load(rank_file)
    except (ValueError, OSError, RuntimeError) as e:
        return cli.fail(e)
    name = args.served_model_name or (
        (args.model if not Path(args.model).expanduser().is_dir() else model_path.name)
        if args.model
        else "gpt-oss-demo"
    )
    engine = AsyncEngine(_engine_factory(args, model_path, ec))
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
            max_stored_responses=args.max_stored_responses,
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
        except (ValueError, OSError, RuntimeError) as e:  # a user's error (a tensor, a size): one line
            log.error("start-up failed: %s", e)
            server_box["failed"] = True
            server_box["server"].should_exit = True
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
    if args.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=args.allowed_origins,
            allow_methods=args.allowed_methods,
            allow_headers=args.allowed_headers,
            allow_credentials=args.allow_credentials,
        )
    config = uvicorn.Config(
        _RequestLog(app) if args.enable_log_requests else app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        http=HeaderTimeoutProtocol,
        # The drain (`DrainingServer`) ends requests at --shutdown-timeout; uvicorn cancels what is left a bit later.
        timeout_graceful_shutdown=args.shutdown_timeout + DrainingServer.grace_s,
        root_path=args.root_path,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        access_log=not args.disable_uvicorn_access_log,
    )
    server = DrainingServer(config, st, args.shutdown_timeout)
    server_box["server"] = server
    server.run()
    return 1 if server_box.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
