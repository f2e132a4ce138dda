"""The Sentinel topology of the cluster chaos run (bench/chaos_cluster.py --redis sentinel), in pods.

In the run's namespace: a StatefulSet ``redis`` of 2 pods (a primary and its replica) and a
StatefulSet ``sentinel`` of 3 pods (quorum 2, down-after 3 s), each behind a headless
Service that publishes pods before they are Ready (the startup scripts find each other by
name). The image is the chart's bundled Redis (tooling/images/redis.Dockerfile: Debian's
redis-server and redis-cli, /bin/sh). No persistence (emptyDir), no password. Each pod
announces its own IP (the downward API), so clients, replicas and Sentinels all speak IPs.

Startup, so that a recreated pod rejoins correctly:
- a data pod asks the Sentinels for the current master and starts as its replica once that
  master answers PING as a master and is not itself. While the Sentinels name an address
  that does not answer (the primary deleted and recreated before they noticed: its old IP,
  or its own IP given again) it waits for their failover to the replica instead of starting
  empty as a primary. With no Sentinel answering (the first start only: a Sentinel starts
  once redis-0 or another Sentinel answers) pod 0 starts as the primary and pod 1 as its
  replica.
  Once started, a data pod follows the Sentinels: a replica of a master they no longer
  name is repointed at the one a majority names (a primary whose pod was force-deleted may
  run on for a while: a pod that joined it then is one the Sentinels may not know yet, and
  they would not reconfigure it when it dies).
- a Sentinel learns the master from the other Sentinels, else from redis-0's address once
  it answers; it keeps its id across container restarts.
After a failover the Sentinels keep the dead primary's address as a replica that is down;
:func:`reset_sentinels` (SENTINEL RESET, one Sentinel at a time) drops it once the
recreated pod is a synced replica.

The host (the producer, the checks) reaches pods through a route to the pod network via
the node (:func:`route_pods`), as ``redis_on_host`` does for the bundled Redis' Service.
"""

from __future__ import annotations

import subprocess
import time

import redis
import yaml

from tooling.testbed import REPO_ROOT

SERVICE = "mymaster"
DATA = "redis"
SENTINELS = "sentinel"
DATA_PODS = 2
SENTINEL_PODS = 3
QUORUM = 2
DOWN_AFTER_MS = 3000
FAILOVER_TIMEOUT_MS = 10000
SENTINEL_PORT = 26379

# Shell helpers both scripts use (sh, Debian's dash): `say` logs with a time stamp;
# `master_named_by N` prints "ip port" as Sentinel N names the master, or nothing (no
# answer, no such master, or a reply that is no IP address); `answers_as_master IP PORT`
# is true when that Redis answers PING and says it is a master.
_HELPERS = r"""
set -u
say() { echo "[$(date +%H:%M:%S)] $HOSTNAME: $*"; }
master_named_by() {
  set -- $(timeout 3 redis-cli -h "sentinel-$1.sentinel.$NAMESPACE.svc" -p 26379 \
      SENTINEL get-master-addr-by-name mymaster 2>/dev/null)
  [ $# -ge 2 ] || return 0
  case "$1" in *[!0-9.]*) return 0 ;; esac
  echo "$1 $2"
}
answers_as_master() {
  [ "$(timeout 3 redis-cli -h "$1" -p "$2" PING 2>/dev/null)" = PONG ] &&
    [ "$(timeout 3 redis-cli -h "$1" -p "$2" ROLE 2>/dev/null | head -n 1)" = master ]
}
redis0() { getent hosts "redis-0.redis.$NAMESPACE.svc" | awk '{print $1; exit}'; }
"""

DATA_SCRIPT = _HELPERS + r"""
ordinal="${HOSTNAME##*-}"
conf=/data/redis.conf
cat >"$conf" <<EOF
port 6379
bind 0.0.0.0
protected-mode no
dir /data
save ""
appendonly no
maxmemory-policy noeviction
replica-announce-ip $POD_IP
repl-diskless-sync yes
repl-diskless-sync-delay 0
EOF
while :; do
  heard="" master=""
  for i in 0 1 2; do
    named="$(master_named_by $i)"
    [ -n "$named" ] || continue
    heard="$heard sentinel-$i:${named% *}"
    set -- $named
    # not itself: a recreated pod may be given the old primary's IP
    if [ "$1" != "$POD_IP" ] && answers_as_master "$1" "$2"; then master="$named"; break; fi
  done
  if [ -n "$master" ]; then
    say "replica of $master, the master the Sentinels name"
    echo "replicaof $master" >>"$conf"
    break
  fi
  if [ -z "$heard" ]; then  # no Sentinel answers: the first start
    if [ "$ordinal" = 0 ]; then say "no Sentinel answers: starting as the primary"; break; fi
    ip="$(redis0)"
    if [ -n "$ip" ] && answers_as_master "$ip" 6379; then
      say "no Sentinel answers: replica of redis-0 at $ip"
      echo "replicaof $ip 6379" >>"$conf"
      break
    fi
    say "no Sentinel answers, redis-0 does not answer as a master yet: waiting"
  else
    say "the Sentinels name${heard}; no master answers there (or it is me, $POD_IP): waiting for their failover"
  fi
  sleep 1
done
# Then, in the background, follow the Sentinels: a replica whose master they no longer name is
# repointed at the one a majority of them names (when it answers and is not this pod). They
# reconfigure only the replicas they know, from the master's INFO every 10 s: a pod that joined
# an old primary still running after its pod's forced deletion would stay behind it when it died.
follow_the_sentinels() {
  while sleep 2; do
    named="$(for i in 0 1 2; do master_named_by $i; done | sort | uniq -c | awk '$1 >= 2 {print $2, $3; exit}')"
    [ -n "$named" ] || continue
    set -- $named
    [ "$1" != "$POD_IP" ] || continue
    mine="$(timeout 3 redis-cli -p 6379 INFO replication 2>/dev/null | tr -d '\r' |
      awk -F: '$1 == "role" {role = $2} $1 == "master_host" {host = $2} END {print role, host}')"
    [ "$mine" != "slave $1" ] || continue
    [ -n "${mine% *}" ] && answers_as_master "$1" "$2" || continue
    say "the Sentinels name $1 $2 the master, this Redis is ${mine}: REPLICAOF $1 $2"
    timeout 3 redis-cli -p 6379 REPLICAOF "$1" "$2" >/dev/null
  done
}
follow_the_sentinels &
exec redis-server "$conf"
"""

SENTINEL_SCRIPT = _HELPERS + r"""
conf=/data/sentinel.conf
myid="$(awk '$1 == "sentinel" && $2 == "myid" {print $3}' "$conf" 2>/dev/null || true)"
while :; do
  master=""
  for i in 0 1 2; do
    [ "sentinel-$i" = "$HOSTNAME" ] && continue
    master="$(master_named_by $i)"
    if [ -n "$master" ]; then say "sentinel-$i names the master $master"; break; fi
  done
  if [ -z "$master" ]; then
    ip="$(redis0)"
    if [ -n "$ip" ] && answers_as_master "$ip" 6379; then
      master="$ip 6379"
      say "no other Sentinel answers: redis-0 at $ip is the master"
    fi
  fi
  [ -n "$master" ] && break
  sleep 1
done
cat >"$conf" <<EOF
port 26379
protected-mode no
dir /data
sentinel announce-ip $POD_IP
sentinel monitor mymaster $master 2
sentinel down-after-milliseconds mymaster 3000
sentinel failover-timeout mymaster 10000
sentinel parallel-syncs mymaster 1
EOF
if [ -n "$myid" ]; then echo "sentinel myid $myid" >>"$conf"; fi
exec redis-server "$conf" --sentinel
"""


def redis_image() -> str:
    """The chart's bundled Redis image, as the chart names it (values.yaml redis.image, the
    tag defaulting to the chart's appVersion)."""
    chart = REPO_ROOT / "charts" / "effectmq"
    image = yaml.safe_load((chart / "values.yaml").read_text())["redis"]["image"]
    if image.get("digest"):
        return f"{image['repository']}@{image['digest']}"
    tag = image.get("tag") or yaml.safe_load((chart / "Chart.yaml").read_text())["appVersion"]
    return f"{image['repository']}:{tag}"


def _service(name: str, port: int) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {"app.kubernetes.io/name": name},
                     "ports": [{"name": name, "port": port, "targetPort": port}]}}


def _statefulset(name: str, replicas: int, port: int, script: str) -> dict:
    ping = ["sh", "-c", f"redis-cli -p {port} ping | grep -qx PONG"]
    container = {
        "name": name, "image": redis_image(), "imagePullPolicy": "IfNotPresent",
        "command": ["sh", "-c", script],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
        "ports": [{"name": name, "containerPort": port}],
        # no liveness probe: a data pod waiting for a failover must not be restarted for it
        "readinessProbe": {"exec": {"command": ping}, "periodSeconds": 2, "timeoutSeconds": 3},
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "128Mi"}},
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": name},
            "spec": {"serviceName": name, "replicas": replicas, "podManagementPolicy": "Parallel",
                     "selector": {"matchLabels": {"app.kubernetes.io/name": name}},
                     "template": {"metadata": {"labels": {"app.kubernetes.io/name": name}},
                                  "spec": {"terminationGracePeriodSeconds": 5, "enableServiceLinks": False,
                                           "automountServiceAccountToken": False, "containers": [container],
                                           "volumes": [{"name": "data", "emptyDir": {}}]}}}}


def manifests() -> list[dict]:
    return [_service(DATA, 6379), _service(SENTINELS, SENTINEL_PORT),
            _statefulset(DATA, DATA_PODS, 6379, DATA_SCRIPT),
            _statefulset(SENTINELS, SENTINEL_PODS, SENTINEL_PORT, SENTINEL_SCRIPT)]


def cluster_url(namespace: str) -> str:
    """The Queue's URL: the Sentinels by their pods' names (the cluster's DNS)."""
    hosts = ",".join(f"{SENTINELS}-{i}.{SENTINELS}.{namespace}.svc:{SENTINEL_PORT}" for i in range(SENTINEL_PODS))
    return f"redis+sentinel://{hosts}/{SERVICE}/0"


def host_url(sentinel_ips: list[str]) -> str:
    """The URL as the host reaches the Sentinels: their pod IPs (the host resolves no cluster names)."""
    return f"redis+sentinel://{','.join(f'{ip}:{SENTINEL_PORT}' for ip in sentinel_ips)}/{SERVICE}/0"


def route_pods(pod_cidr: str, node_ip: str) -> bool:
    """A host route to the pod network via the node, unless one is there (the stall tests'
    fixture adds it too); True when this call added it (then :func:`forget_pod_route`)."""
    shown = subprocess.run(["ip", "route", "show", "exact", pod_cidr], capture_output=True, text=True).stdout
    if shown.strip():
        return False
    subprocess.run(["ip", "route", "replace", pod_cidr, "via", node_ip], check=True)
    return True


def forget_pod_route(pod_cidr: str) -> None:
    subprocess.run(["ip", "route", "del", pod_cidr], capture_output=True)


def client(ip: str, port: int = 6379, timeout: float = 2.0) -> redis.Redis:
    return redis.Redis(host=ip, port=port, socket_timeout=timeout, socket_connect_timeout=timeout,
                       decode_responses=True)


def named_master(sentinel_ip: str) -> str | None:
    """The master's IP one Sentinel names (None: no answer)."""
    try:
        with client(sentinel_ip, SENTINEL_PORT) as c:
            address = c.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
    except (redis.RedisError, OSError):
        return None
    return address[0] if address else None


def agreed_master(sentinel_ips: list[str]) -> str | None:
    """The master's IP when every Sentinel answers and names the same one."""
    named = {named_master(ip) for ip in sentinel_ips}
    return named.pop() if len(named) == 1 and None not in named else None


def replication(ip: str) -> dict:
    """INFO replication of the Redis at `ip` ({} when it does not answer)."""
    try:
        with client(ip) as c:
            return c.info("replication")
    except (redis.RedisError, OSError):
        return {}


def in_sync_replica(ip: str, master_ip: str) -> bool:
    info = replication(ip)
    return (info.get("role") == "slave" and info.get("master_host") == master_ip
            and info.get("master_link_status") == "up")


def sentinels_settled(sentinel_ips: list[str], master_ip: str, replica_ip: str) -> str | None:
    """Why the Sentinels could not yet fail over from `master_ip` to `replica_ip` (None: they
    could): each names that master with no failover under way, knows the replica up and
    the other Sentinels."""
    for ip in sentinel_ips:
        try:
            with client(ip, SENTINEL_PORT) as c:
                state = c.sentinel_master(SERVICE)
                replicas = c.sentinel_slaves(SERVICE)
        except (redis.RedisError, OSError) as exc:
            return f"sentinel {ip}: {type(exc).__name__}: {exc}"
        if state.get("ip") != master_ip or state.get("flags") != "master":
            return f"sentinel {ip}: master {state.get('ip')} flags {state.get('flags')}"
        if int(state.get("num-other-sentinels", 0)) < SENTINEL_PODS - 1:
            return f"sentinel {ip}: knows {state.get('num-other-sentinels')} other Sentinels"
        if not any(r.get("ip") == replica_ip and r.get("flags") == "slave" for r in replicas):
            known = [(r.get("ip"), r.get("flags")) for r in replicas]
            return f"sentinel {ip}: replica {replica_ip} not known up ({known})"
    return None


def stale_replicas(sentinel_ip: str, live_ips: set[str]) -> list[str]:
    """The replicas a Sentinel lists at addresses no data pod has (a dead primary's)."""
    try:
        with client(sentinel_ip, SENTINEL_PORT) as c:
            return [r["ip"] for r in c.sentinel_slaves(SERVICE) if r.get("ip") not in live_ips]
    except (redis.RedisError, OSError):
        return []


def reset_sentinels(sentinel_ips: list[str], master_ip: str, replica_ip: str, timeout: float = 30.0) -> list[str]:
    """SENTINEL RESET on each Sentinel that lists a replica at a dead address, one at a time,
    each waited for until it knows the replica and its peers again (so a quorum that can
    fail over is never lost); returns what was not settled in time."""
    left = []
    for ip in sentinel_ips:
        if not stale_replicas(ip, {master_ip, replica_ip}):
            continue
        with client(ip, SENTINEL_PORT) as c:
            c.execute_command("SENTINEL", "RESET", SERVICE)
        deadline = time.monotonic() + timeout
        while (why := sentinels_settled([ip], master_ip, replica_ip)) and time.monotonic() < deadline:
            time.sleep(0.5)
        if why:
            left.append(why)
    return left


def pod_log_tail(kubectl, namespace: str, pod: str, lines: int = 20) -> str:
    """The last lines of a pod's log (its startup script says how it joined)."""
    out = kubectl("logs", pod, "-n", namespace, f"--tail={lines}", check=False)
    return out.stdout.strip()
