"""The bundled Redis (`redis.enabled=true`) is protected, the chart's part. It had no
password, `protected-mode no`, `bind *` and no NetworkPolicy. Now it has a password
from a generated (or existing) Secret that no other rendered manifest shows, kept
across upgrades; its container's own command, run here on loopback, refuses a client
without it; everything of the chart that talks to it authenticates. Also the schema's "no credentials" check of
dashboard.redis.url, held against the runtime's notion of a credential."""

from __future__ import annotations

import base64
import json
import re
import socket
from pathlib import Path
from urllib.parse import quote, quote_plus

import jsonschema
import pytest
import redis as redis_client
import yaml

from effectmq.transport.redaction import url_secrets
from tests.chart.support import (CHART, FULLNAME, RELEASE, ContainerRedis, assert_redis_url_from_secret_file, docs,
                                 find, get_object, helm_template, render)
from tests.support.processes import ROOT

pytestmark = pytest.mark.kube

NAMESPACE = "shop"
REDIS = f"{FULLNAME}-redis"
ON = ["--set", "redis.enabled=true", "--set", "dashboard.enabled=true"]
# A password with everything redis.conf's quoting and the shell could trip on.
NASTY = 'p"a\\ss w$(id)`x`\'o#rd;\\"\\x41'


def decoded(secret: dict) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()} | secret.get("stringData", {})


def forms(secret: str) -> set[str]:
    """How a secret could appear in a manifest: as is, encoded for URLs, in base64."""
    return {secret, quote(secret, safe=""), quote_plus(secret), base64.b64encode(secret.encode()).decode()}


def raw_ping(port: int) -> bytes:
    """A PING as the first and only command of a connection: no AUTH, no HELLO."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"PING\r\n")
        return conn.recv(200)


def the_redis(objects: list[dict]) -> tuple[dict, dict]:
    return find(objects, "StatefulSet", REDIS), find(objects, "ConfigMap", REDIS)


def test_the_password_appears_in_no_manifest_but_its_secret(kube_control_plane):
    """With the bundled Redis (and every part that talks to it) on, the
    generated password is in the Secret's data and nowhere else."""
    rendered = helm_template(kube_control_plane, NAMESPACE, *ON).stdout
    objects = docs(rendered)
    secret = find(objects, "Secret", REDIS)
    data = decoded(secret)
    password = data["password"]
    assert re.fullmatch(r"[A-Za-z0-9]{32}", password), "a random alphanumeric password"
    assert data["url"] == f"redis://:{password}@{REDIS}.{NAMESPACE}.svc:6379/0"
    documents = [d for d in re.split(r"^---\s*$", rendered, flags=re.M) if d.strip()]
    holders = [d for d in documents if any(f in d for f in forms(password))]
    assert len(holders) == 1 and "kind: Secret" in holders[0], [d[:200] for d in holders]
    # and a second rendering makes another one (no fixed default password)
    again = decoded(find(render(kube_control_plane, NAMESPACE, *ON), "Secret", REDIS))["password"]
    assert again != password


def test_the_redis_config_protects_and_includes_the_password(kube_control_plane):
    statefulset, config_map = the_redis(render(kube_control_plane, NAMESPACE, "--set", "redis.enabled=true"))
    conf = config_map["data"]["redis.conf"]
    assert re.search(r"^protected-mode yes$", conf, re.M) and "protected-mode no" not in conf
    assert not re.search(r"^\s*requirepass", conf, re.M)  # it is written at start from the Secret's file
    (include,) = re.findall(r"^include (\S+)$", conf, re.M)
    container = statefulset["spec"]["template"]["spec"]["containers"][0]
    command = container["command"]
    assert command[:2] == ["sh", "-c"] and "requirepass" in command[2] and include in command[2]
    assert not any(e.get("value") for e in container.get("env", []))
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in statefulset["spec"]["template"]["spec"]["volumes"]}
    assert "emptyDir" in volumes[mounts[include.rsplit("/", 1)[0]]], "the include is written to an emptyDir"
    assert volumes["password"]["secret"]["secretName"] == REDIS
    assert container["image"] == "effectmq-redis:0.1.0"  # the chart's appVersion, like the operator's image


def test_an_unauthenticated_client_is_refused_by_the_rendered_redis(kube_control_plane, tmp_path):
    """The StatefulSet's own command, run on loopback with the rendered
    redis.conf and the Secret's file, refuses PING without the password (NOAUTH); the
    Secret's URL works, and so does the container's readiness probe."""
    objects = render(kube_control_plane, NAMESPACE, "--set", "redis.enabled=true")
    statefulset, config_map = the_redis(objects)
    data = decoded(find(objects, "Secret", REDIS))
    server = ContainerRedis(statefulset, config_map, {REDIS: data}, tmp_path).start()
    try:
        assert raw_ping(server.port).startswith(b"-NOAUTH"), raw_ping(server.port)
        stranger = redis_client.Redis(port=server.port, socket_timeout=5)
        with pytest.raises(redis_client.AuthenticationError):
            stranger.ping()
        url = data["url"].replace(f"{REDIS}.{NAMESPACE}.svc:6379", f"127.0.0.1:{server.port}")
        client = redis_client.Redis.from_url(url, socket_timeout=5, decode_responses=True)
        assert client.ping()
        assert client.config_get("protected-mode") == {"protected-mode": "yes"}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        include = Path(re.search(r"^include (\S+)$", server.config_path.read_text(), re.M).group(1))
        assert include.read_text().startswith('requirepass "')
        assert include.stat().st_mode & 0o077 == 0, oct(include.stat().st_mode)  # umask 077
        ready = server.probe("readinessProbe")
        assert ready.returncode == 0, ready.stdout + ready.stderr
        client.close()
        stranger.close()
    finally:
        server.stop()
    # the probe fails against a Redis that refuses its password
    wrong = ContainerRedis(statefulset, config_map, {REDIS: data}, tmp_path / "wrong").start()
    try:
        (wrong.volume_dir("password") / "password").write_text("not-the-password")
        assert wrong.probe("readinessProbe").returncode != 0
    finally:
        wrong.stop()


def test_an_existing_secret_with_any_password_works(kube_control_plane, tmp_path):
    """redis.auth.existingSecret: no Secret is generated, the user's keys are used, and
    a password with quotes, backslashes and shell syntax still works (escaped for
    redis.conf by the container's command, never evaluated)."""
    objects = render(kube_control_plane, NAMESPACE, *ON, "--set", "redis.auth.existingSecret=my-redis",
                     "--set", "redis.auth.existingSecretPasswordKey=pw", "--set", "redis.auth.existingSecretUrlKey=u")
    assert not [o for o in objects if o["kind"] == "Secret"]
    statefulset, config_map = the_redis(objects)
    volume = {v["name"]: v for v in statefulset["spec"]["template"]["spec"]["volumes"]}["password"]
    assert volume["secret"]["secretName"] == "my-redis" and volume["secret"]["items"][0]["key"] == "pw"
    dashboard = find(objects, "Deployment", f"{FULLNAME}-dashboard")["spec"]["template"]["spec"]
    assert_redis_url_from_secret_file(dashboard, "my-redis", "u")
    server = ContainerRedis(statefulset, config_map, {"my-redis": {"pw": NASTY + "\n"}}, tmp_path).start()
    try:
        with pytest.raises(redis_client.AuthenticationError):
            redis_client.Redis(port=server.port, socket_timeout=5).ping()
        assert redis_client.Redis(port=server.port, password=NASTY, socket_timeout=5).ping()
        assert server.probe("readinessProbe").returncode == 0
    finally:
        server.stop()


def test_a_password_with_a_line_break_stops_the_container_with_a_reason(kube_control_plane, tmp_path):
    objects = render(kube_control_plane, NAMESPACE, "--set", "redis.enabled=true")
    statefulset, config_map = the_redis(objects)
    server = ContainerRedis(statefulset, config_map, {REDIS: {"password": "two\nlines"}}, tmp_path)
    with pytest.raises(AssertionError, match="line break"):
        server.start()


def test_everything_of_the_chart_that_talks_to_redis_authenticates(kube_control_plane):
    """The dashboard's default URL and the helm-test pod's come from the Secret's `url`
    key (a reference, never the value); the example Queue names that Secret."""
    objects = render(kube_control_plane, NAMESPACE, *ON)
    dashboard = find(objects, "Deployment", f"{FULLNAME}-dashboard")["spec"]["template"]["spec"]
    assert_redis_url_from_secret_file(dashboard, REDIS, "url")
    test_pod = find(objects, "Pod")
    container = test_pod["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert "EFFECTMQ_TEST_REDIS_URL" not in env and env["EFFECTMQ_TEST_REDIS_AUTH"] == "required"
    url_file = env["EFFECTMQ_TEST_REDIS_URL_FILE"]
    mount = next(m for m in container["volumeMounts"] if url_file.startswith(m["mountPath"] + "/"))
    volume = {v["name"]: v for v in test_pod["spec"]["volumes"]}[mount["name"]]
    assert volume["secret"]["secretName"] == REDIS and volume["secret"]["items"] == [
        {"key": "url", "path": url_file.rsplit("/", 1)[1]}]
    queue = yaml.safe_load((ROOT / "examples/k8s/queue.yaml").read_text())
    assert queue["spec"]["redis"] == {"urlFrom": {"secretKeyRef": {"name": "effectmq-redis", "key": "url"}}}


def test_auth_can_be_turned_off_and_then_says_so(kube_control_plane):
    objects = render(kube_control_plane, NAMESPACE, *ON, "--set", "redis.auth.enabled=false")
    assert not [o for o in objects if o["kind"] == "Secret"]
    _, config_map = the_redis(objects)
    conf = config_map["data"]["redis.conf"]
    assert "include" not in conf and re.search(r"^protected-mode no$", conf, re.M)  # else only loopback answers
    dashboard = find(objects, "Deployment", f"{FULLNAME}-dashboard")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in dashboard["env"]}
    assert env["EFFECTMQ_REDIS_URL"]["value"] == f"redis://{REDIS}.{NAMESPACE}.svc:6379/0"


def test_the_password_survives_helm_upgrade(kube_control_plane, make_namespace):
    """`lookup`: an upgrade keeps the generated password (the running Redis keeps its
    own until restarted, and every client reads the Secret)."""
    plane = kube_control_plane
    namespace = make_namespace("redis-auth")
    plane.helm("install", RELEASE, str(CHART), "-n", namespace, "--set", "redis.enabled=true",
               "--set", "redis.persistence.enabled=false")
    try:
        first = decoded(get_object(plane, "secret", namespace, REDIS))
        plane.helm("upgrade", RELEASE, str(CHART), "-n", namespace, "--reuse-values", "--set", "verbose=true")
        assert decoded(get_object(plane, "secret", namespace, REDIS)) == first
        notes = plane.helm("get", "notes", RELEASE, "-n", namespace).stdout
        assert f"secretKeyRef: {{name: {REDIS}, key: url}}" in notes and first["password"] not in notes
    finally:
        plane.helm("uninstall", RELEASE, "-n", namespace, "--wait", "--timeout", "60s", check=False)


# --------------------------------------------------------------------------
# values.schema.json: dashboard.redis.url must carry no credential

URLS = [  # (url, what the runtime's url_secrets finds in it)
    ("redis://redis:6379/0", False),
    ("rediss://redis.example:6380/1", False),
    ("unix:///run/redis.sock?db=2", False),
    ("redis+sentinel://s1:26379,s2:26379/mymaster/0", False),
    ("rediss+sentinel://s1:26379/mymaster/0?ssl_cert_reqs=required", False),
    ("redis+cluster://n1:7000,n2:7001", False),
    ("redis://h:6379/0?username=reader", False),
    ("redis://h:6379/0?password=", False),
    ("redis://:hunter2@redis:6379/0", True),
    ("redis://reader:hunter2@redis:6379/0", True),
    ("redis://h:6379/0?password=x", True),
    ("redis://h:6379/0?db=1&PassWord=x", True),
    ("redis://h:6379/0?pass%77ord=x", True),
    ("redis://h:6379/0?username=reader&password=x", True),
    ("rediss://h:6380/0?ssl_password=x", True),
    ("redis+sentinel://s1:26379/mymaster/0?sentinel_password=x", True),
    ("redis+cluster://:hunter2@n1:7000,n2:7001", True),
]


def schema_of_dashboard_url() -> dict:
    schema = json.loads((CHART / "values.schema.json").read_text())
    return schema["properties"]["dashboard"]["properties"]["redis"]["properties"]["url"]


@pytest.mark.parametrize("url,secret", URLS, ids=[u for u, _ in URLS])
def test_the_schema_refuses_exactly_the_urls_the_runtime_finds_a_secret_in(url, secret):
    assert bool(url_secrets(url)) is secret  # the runtime's notion (effectmq.transport.redaction)
    valid = jsonschema.Draft7Validator(schema_of_dashboard_url()).is_valid(url)
    assert valid is not secret, f"{url}: the schema {'accepts' if valid else 'refuses'} it"


@pytest.mark.parametrize("url", ["redis://h:6379/0?password=x", "redis://h:6379/0?Sentinel_Password=x",
                                 "redis+sentinel://s1:26379/mymaster/0"])
def test_helm_applies_the_same_check(kube_control_plane, url):
    """The same patterns under helm's own schema validator (Go regular expressions)."""
    result = helm_template(kube_control_plane, NAMESPACE, "--set", "dashboard.enabled=true",
                           "--set", f"dashboard.redis.url={url}", check=False)
    if url_secrets(url):
        assert result.returncode != 0 and "/dashboard/redis/url" in result.stderr, result.stderr
    else:
        assert result.returncode == 0, result.stderr
