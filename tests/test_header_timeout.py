"""``--header-read-timeout``: a request's headers must arrive within the deadline, counted from the connection's
start or the previous response's end (a slowloris client cannot hold connections), and nothing else is cut."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest

uvicorn = pytest.importorskip("uvicorn")

from paged_backend.entrypoints.openai.cli_args import parse_args  # noqa: E402
from paged_backend.entrypoints.openai.header_timeout import http_protocol  # noqa: E402

# the deadlines are timed: with no other xdist worker running a test (tests/conftest.py)
pytestmark = pytest.mark.exclusive

DEADLINE = 0.5
REQUEST = b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"


async def app(scope, receive, send) -> None:  # the handler takes longer than the headers' deadline
    if scope["type"] != "http":
        return
    await asyncio.sleep(DEADLINE * 2)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def address() -> Iterator[tuple[str, int]]:
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", http=http_protocol(DEADLINE))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    yield server.servers[0].sockets[0].getsockname()[:2]
    server.should_exit = True
    thread.join(timeout=10)


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def test_headers_sent_a_byte_at_a_time_get_a_408_and_the_connection_closes(address) -> None:
    with socket.create_connection(address, timeout=10) as sock:
        start = time.monotonic()
        try:
            for byte in REQUEST[:-2]:  # never the blank line that ends the headers
                sock.sendall(bytes([byte]))
                time.sleep(0.05)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 408") and b"--header-read-timeout" in answer, answer
    assert DEADLINE - 0.1 <= time.monotonic() - start < DEADLINE + 2


def test_a_connection_that_sends_nothing_is_closed(address) -> None:
    with socket.create_connection(address, timeout=10) as sock:
        start = time.monotonic()
        assert read_all(sock) == b""
    assert DEADLINE - 0.1 <= time.monotonic() - start < DEADLINE + 2


def test_the_next_request_on_a_kept_alive_connection_has_the_same_deadline(address) -> None:
    """A handler slower than the deadline is not cut; the deadline starts again once its response has gone."""
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(REQUEST)
        first = sock.recv(4096)
        while not first.endswith(b"ok") and (more := sock.recv(4096)):  # the body may come in a segment of its own
            first += more
        assert first.startswith(b"HTTP/1.1 200") and first.endswith(b"ok"), first
        start = time.monotonic()
        sock.sendall(REQUEST[:10])
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert DEADLINE - 0.1 <= time.monotonic() - start < DEADLINE + 2


def test_the_flag_parses_and_refuses_a_bad_value(capsys) -> None:
    args, _ = parse_args(["--model", "m", "--header-read-timeout", "7.5"], "serve")
    assert args.header_read_timeout == 7.5
    assert parse_args(["--model", "m"], "serve")[0].header_read_timeout == 20.0
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--header-read-timeout", "0"], "serve")
    assert "--header-read-timeout must be a number of seconds > 0" in capsys.readouterr().err
