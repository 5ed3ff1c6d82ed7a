"""The server's connection-level limits (what uvicorn reads before the app sees a request).

Why a protocol class of our own: uvicorn bounds the header block only through h11
(``h11_max_incomplete_event_size``; its httptools parser took 64 MB of headers), and it has no
timeout for a client that opens a connection and sends its headers a byte a second (its keep-alive
timer runs only between requests). ``GuardedH11Protocol`` is uvicorn's h11 protocol with a deadline
for the header block: armed when the connection opens and when a request's first byte arrives,
disarmed once the request line and headers are read; past it the client gets 408 and the connection
is closed. The body's own limit is the app's (app.py ``read_json``, MAX_BODY_BYTES, 413).
"""

from __future__ import annotations

import json

HEADER_TIMEOUT_S = 10.0  # from a connection's first byte (or its opening) to the end of the request's headers
MAX_HEADER_BYTES = 64 * 1024  # the request line and headers together; past it h11 refuses (400)


def guarded_protocol():
    """uvicorn's H11Protocol with the header deadline (a class: uvicorn.Config(http=...) takes it)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        _header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                if self._header_timer is None:  # waiting for (the rest of) a request's headers
                    self._header_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._header_timeout)
            else:
                self._disarm()

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
                return
            body = json.dumps({"error": {"message": f"the request's headers did not arrive within "
                                                    f"{HEADER_TIMEOUT_S:g} s", "type": "invalid_request_error",
                                         "param": None, "code": "request_timeout"}}).encode()
            head = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                    b"content-length: " + str(len(body)).encode() + b"\r\n\r\n")
            self.transport.write(head + body)
            self.transport.close()

    return GuardedH11Protocol


def uvicorn_limits() -> dict:
    """uvicorn.Config's keyword arguments for the limits above."""
    return {"http": guarded_protocol(), "h11_max_incomplete_event_size": MAX_HEADER_BYTES}
