"""uvicorn with a request-header timeout (`HeaderTimeoutProtocol`) and a draining shutdown (`DrainingServer`).

uvicorn times out idle kept-alive connections but not a client that sends its request line and headers slowly
(slowloris) or never finishes them: each such connection would hold a socket forever. Here a request's headers must
be complete within `header_timeout_s` of the connection opening (or of the first bytes of the next request on a
kept-alive connection), else the connection is closed. The body has its own limit in the app
(`ServerConfig.body_timeout_s`).
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("gptoss_jax.server")
HEADER_TIMEOUT_S = 30.0


class HeaderTimeoutProtocol(H11Protocol):
    header_timeout_s = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        self._waiting_after = None  # the request cycle whose successor's headers are awaited
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _timed_out(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            log.info("closing a connection whose request headers did not arrive within %gs", self.header_timeout_s)
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not self._waiting_after:  # a new request's headers are complete
            self._disarm()
        elif self._header_timer is None and not self.transport.is_closing():
            self._arm()  # the first bytes of the next request on a kept-alive connection

    def on_response_complete(self) -> None:
        # An idle kept-alive connection is uvicorn's keep-alive timeout's; the clock starts with the next bytes.
        self._disarm()
        self._waiting_after = self.cycle
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


class DrainingServer(uvicorn.Server):
    """uvicorn's shutdown (stop accepting, wait for the open connections) with a drain: new requests on open
    connections get 503, running ones may finish for `drain_s` seconds, then each ends with an error (`State.cut_off`:
    streams get an error event and [DONE], the others a 503). Give uvicorn `timeout_graceful_shutdown = drain_s +
    grace_s`, so the errors go out before it cancels what is left."""

    grace_s = 5.0

    def __init__(self, config: uvicorn.Config, st, drain_s: float):
        super().__init__(config)
        self.st, self.drain_s = st, drain_s

    async def shutdown(self, sockets=None) -> None:
        self.st.begin_drain()
        timer = asyncio.get_running_loop().call_later(self.drain_s, self.st.cut_off, self.drain_s)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
