"""The server's listening socket, bound before the model loads."""

from __future__ import annotations

import socket


def bind(host: str, port: int, prog: str) -> socket.socket:
    """The server's listening socket, bound before the model loads (which takes minutes for a large one): a port
    in use ends the command at once with one line saying so."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart need not wait
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        raise SystemExit(
            f"{prog}: cannot listen on {host}:{port}: {exc.strerror or exc} (another server on that port? --port "
            "picks another)"
        ) from None
    listener.set_inheritable(True)
    return listener
