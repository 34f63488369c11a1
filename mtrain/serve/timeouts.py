"""Closing connections that never finish a request (half-open, slow-loris): uvicorn's keep-alive timer only runs
between a finished response and the next byte, so a client that opens a connection and sends nothing, or half a
request line, keeps it forever.

`timed_protocol(read_timeout_s)` is uvicorn's h11 protocol with one more timer: every `read_timeout_s` it checks
that the connection is inside a request (its headers were read and its response is not finished) or has started a
new one since the last check; a connection that waited for a request's headers for a whole period is closed. A
request body that does not arrive is bounded by the handler (`app.body_of`, same timeout). A streamed response that
runs for minutes is never cut: the connection is inside its request.
"""
from __future__ import annotations

from uvicorn.protocols.http.h11_impl import H11Protocol


def timed_protocol(read_timeout_s: float) -> type[H11Protocol]:
    class TimedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._seen_cycle = None
            self._read_timer = self.loop.call_later(read_timeout_s, self._check_read)

        def _check_read(self) -> None:
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and self.cycle is self._seen_cycle:  # no new request for a whole period
                if not self.transport.is_closing():
                    self.transport.close()
                return
            self._seen_cycle = self.cycle
            self._read_timer = self.loop.call_later(read_timeout_s, self._check_read)

        def connection_lost(self, exc) -> None:  # type: ignore[override]
            self._read_timer.cancel()
            super().connection_lost(exc)

    return TimedH11Protocol
