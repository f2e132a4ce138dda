"""rediss:// checks the server's name against its certificate on every supported redis-py
(redis-py 5.x did not by default, and 5.x is supported and tested)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import redis

from effectmq.transport.connection import TlsOptions, connect
from effectmq.errors import RedisUnavailable
from tests.fixtures.redis import free_port, require_binary


def _certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 only, made with openssl."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=effectmq test CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "2", "-extfile", "san.ext")
    return folder / "ca.crt", folder / "server.crt", folder / "server.key"


# The check is the client's; the 6.2 server of the floor pass is built without TLS.
pytestmark = pytest.mark.redis7


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    ca, cert, key = _certificates(folder)
    port = free_port()
    server = subprocess.Popen([require_binary("redis-server", "install redis-server"), "--port", "0",
                               "--tls-port", str(port), "--bind", "127.0.0.1 127.0.0.2", "--save", "",
                               "--appendonly", "no", "--tls-cert-file", str(cert), "--tls-key-file", str(key),
                               "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no", "--dir", str(folder)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with redis.Redis(port=port, ssl=True, ssl_ca_certs=str(ca), ssl_check_hostname=False) as probe:
                probe.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield port, ca
    server.terminate()
    server.wait(10)


async def _ping(url: str, tls: TlsOptions) -> None:
    client, _, _ = connect(url=url, tls=tls)
    try:
        await client.ping()
    finally:
        await client.aclose()


async def test_a_certificate_for_another_name_is_refused(tls_redis):
    port, ca = tls_redis
    tls = TlsOptions(enabled=True, ca_file=str(ca))
    await _ping(f"rediss://127.0.0.1:{port}/0", tls)  # the name the certificate has
    with pytest.raises((redis.ConnectionError, RedisUnavailable), match="(?i)hostname|match|certificate"):
        await _ping(f"rediss://127.0.0.2:{port}/0", tls)  # signed by the CA, but for another name


async def test_insecure_still_skips_every_check(tls_redis):
    port, _ = tls_redis
    await _ping(f"rediss://127.0.0.2:{port}/0", TlsOptions(enabled=True, insecure=True))
