"""The worker's metrics server holds no thread per idle connection (200 idle
connections held 202 threads on 8519fde) and names no versions."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

from effectmq.worker import metrics
from tests.fixtures.redis import free_port


def test_idle_connections_get_no_thread_each_and_are_closed():
    port = free_port()
    server = metrics.start_server(port, addr="127.0.0.1")
    try:
        before = threading.active_count()
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
        time.sleep(0.5)
        assert threading.active_count() <= before + metrics.SERVER_THREADS
        time.sleep(metrics.SERVER_IDLE_TIMEOUT + 1.0)  # the idle ones are closed
        for s in idle:
            s.settimeout(2)
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass
            s.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/livez", timeout=5) as reply:
            assert reply.status == 200
            assert reply.headers["Server"] == "effectmq"
    finally:
        server.shutdown()
        server.server_close()
