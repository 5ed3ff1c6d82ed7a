"""issue 38: connection-level limits of `tessera serve` (runtime/serving/http.py), through a real
uvicorn on 127.0.0.1 in this process: a header block past MAX_HEADER_BYTES is refused (before: 64 MB
accepted), a client sending its headers a byte at a time is cut off at HEADER_TIMEOUT_S with a 408
(before: held for ever), and a malformed chunked body is answered without a traceback in the log."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from test_fuzz_serve import serving_client  # noqa: E402


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    with serving_client(tmp_path_factory.mktemp("tok")) as c:
        yield c.app


@pytest.fixture
def url(app, monkeypatch):
    from tessera.runtime.serving import http

    monkeypatch.setattr(http, "HEADER_TIMEOUT_S", 1.0)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_config=None, access_log=False, **http.uvicorn_limits())
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.05)
    yield ("127.0.0.1", port)
    server.should_exit = True
    thread.join(10)
    sock.close()


def _exchange(addr, data: bytes, wait: float = 5.0) -> bytes:
    with socket.create_connection(addr, timeout=wait) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (socket.timeout, ConnectionResetError):
            pass
        return out


def test_an_ordinary_request_is_served(url):
    body = b'{"prompt": [1, 2], "max_tokens": 2}'
    out = _exchange(url, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    assert out.startswith(b"HTTP/1.1 200"), out[:200]


@pytest.mark.parametrize("size", [70_000, 1_000_000, 64_000_000])
def test_headers_past_the_limit_are_refused(url, size):
    """Whole (one read: the app's 431) or in pieces (uvicorn's h11: 400), never read to the end."""
    big = b"x-filler: " + b"a" * size + b"\r\n"
    with socket.create_connection(url, timeout=5) as s:
        try:
            s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n" + big + b"\r\n")
        except OSError:  # the server closed the connection while we sent: refused before the end
            pass
        out = s.recv(65536)
    assert out.startswith((b"HTTP/1.1 400", b"HTTP/1.1 431")), out[:200]


def test_headers_a_byte_at_a_time_time_out(url):
    start = time.monotonic()
    with socket.create_connection(url, timeout=10) as s:
        out = b""
        for byte in b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 100:
            try:
                s.sendall(bytes([byte]))
            except OSError:
                break
            s.settimeout(0.2)
            try:
                got = s.recv(65536)
            except socket.timeout:
                continue
            out += got
            if not got or b"\r\n\r\n" in out:
                break
        assert out.startswith(b"HTTP/1.1 408"), out
        assert b"request_timeout" in out
    assert time.monotonic() - start < 8


def test_a_silent_connection_is_closed(url):
    start = time.monotonic()
    out = _exchange(url, b"", wait=8)
    assert out.startswith(b"HTTP/1.1 408") and time.monotonic() - start < 6


def test_a_malformed_chunked_body_leaves_no_traceback(url, caplog):
    caplog.set_level(logging.DEBUG)
    out = _exchange(url, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"transfer-encoding: chunked\r\n\r\n5\r\n{\"pro\r\nZZZ\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 400"), out[:200]
    time.sleep(0.5)
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    health = _exchange(url, b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    assert health.startswith(b"HTTP/1.1 200")


def test_a_body_a_byte_at_a_time_times_out(url, monkeypatch):
    from tessera.runtime.serving import app as app_module

    monkeypatch.setattr(app_module, "BODY_TIMEOUT_S", 1.0)
    start = time.monotonic()
    with socket.create_connection(url, timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 100\r\n\r\n{\"prompt\"")
        out = b""
        try:
            while b"\r\n\r\n" not in out and (chunk := s.recv(65536)):
                out += chunk
        except socket.timeout:
            pass
    assert out.startswith(b"HTTP/1.1 408"), out[:200]
    assert time.monotonic() - start < 8
