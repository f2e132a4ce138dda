"""TCP endpoints that are not a Redis, on loopback: what a Queue's author could point
spec.redis.url at to map the operator's network."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from typing import Iterator

KINDS = ("closed", "garbage", "silent", "reset")


class Endpoint:
    """closed: nothing listens; garbage: an HTTP server's answer to anything; silent:
    accepts and never answers; reset: accepts and resets the connection."""

    def __init__(self, kind: str):
        self.kind = kind
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._held: list[socket.socket] = []
        self._stopped = threading.Event()
        if kind == "closed":
            self._server.close()
            return
        self._server.settimeout(0.2)
        self._thread = threading.Thread(target=self._serve, daemon=True, name=f"endpoint-{kind}")
        self._thread.start()

    def url(self, scheme: str = "redis") -> str:
        return f"{scheme}://127.0.0.1:{self.port}/0"

    def _serve(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._server.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            if self.kind == "silent":
                self._held.append(conn)  # open, never a byte back
            elif self.kind == "reset":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()
            else:
                threading.Thread(target=self._answer_garbage, args=(conn,), daemon=True).start()

    @staticmethod
    def _answer_garbage(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            with contextlib.suppress(OSError):
                conn.recv(4096)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    def close(self) -> None:
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._server.close()
        for conn in self._held:
            with contextlib.suppress(OSError):
                conn.close()


@contextlib.contextmanager
def endpoints(*kinds: str) -> Iterator[dict[str, Endpoint]]:
    started = {kind: Endpoint(kind) for kind in kinds or KINDS}
    try:
        yield started
    finally:
        for endpoint in started.values():
            endpoint.close()
