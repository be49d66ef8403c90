"""A server-sent-events response that stops (and so aborts generation) when the client disconnects."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from starlette.types import Receive, Scope, Send


class SSEResponse:
    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[str]):
        self.body = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream():
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream; charset=utf-8"),
                        (b"cache-control", b"no-cache"),
                        (b"x-accel-buffering", b"no"),
                    ],
                }
            )
            async for piece in self.body:
                await send({"type": "http.response.body", "body": piece.encode("utf-8"), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def disconnected():
            while True:
                if (await receive())["type"] == "http.disconnect":
                    return

        writer = asyncio.create_task(stream())
        watcher = asyncio.create_task(disconnected())
        try:
            await asyncio.wait({writer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (writer, watcher):
                if not t.done():
                    t.cancel()
            await asyncio.gather(writer, watcher, return_exceptions=True)
            await self.body.aclose()  # runs the generator's cleanup: aborts unfinished requests
        if writer.done() and not writer.cancelled() and writer.exception() is not None:
            exc = writer.exception()
            if not isinstance(exc, OSError):
                raise exc
