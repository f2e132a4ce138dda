"""The chart's observability parts: the dashboard Deployment and Service, the
Grafana dashboard ConfigMap, the ServiceMonitor and PodMonitor, the
PrometheusRule. Off by default; linted and rendered with every part on; the
Grafana JSON decoded strictly by Grafana's own model (grafana-foundation-sdk) and
every PromQL expression parsed by Prometheus' own parser and rule loader, naming
only metrics that a real /metrics scrape of the project's two registries shows;
the monitoring objects decoded strictly into prometheus-operator's own types.

The Go checker is tooling/promql (built by `bash tooling/promql/build.sh`,
located through EFFECTMQ_PROMQL_BIN or the build cache); without it these tests
skip locally and fail under CI=true."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.chart.support import CHART, RELEASE, assert_redis_url_from_secret_file, find, helm_template, render
from tests.fixtures.kube import unavailable
from tests.fixtures.redis import free_port
from tests.support.operator import wait_for
from tests.support.processes import ROOT, stop_process

pytestmark = pytest.mark.kube

PROMQL_BUILD = "bash tooling/promql/build.sh"
DASHBOARD_JSON = CHART / "dashboards" / "effectmq.json"
MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
ALL_ON = ["--set", "dashboard.enabled=true", "--set", "redis.enabled=true",
          "--set", "grafana.dashboard.enabled=true", "--set", "serviceMonitor.enabled=true",
          "--set", "podMonitor.enabled=true", "--set", "prometheusRule.enabled=true"]
WITH_ACTIONS = ["--set", "dashboard.actions.enabled=true", "--set", "dashboard.actions.existingSecret=dash-token"]
ALERTS = {"EffectMQOldestWaitingHigh", "EffectMQStallRateHigh", "EffectMQDeadLettersGrowing",
          "EffectMQMaintenanceLagging", "EffectMQWorkerEventLoopBlocked", "EffectMQOperatorEventLoopBlocked",
          "EffectMQOperatorPollErrors",
          "EffectMQRedisRefusesWrites", "EffectMQStallsClustering"}
OPERATOR_ALERTS = {"EffectMQOperatorEventLoopBlocked"}  # about an operator pod, not a queue
# What users look for on a queue dashboard: one panel each, by title.
PANELS = {"Backlog per state", "Throughput", "Failure rate", "Oldest waiting age", "Stalls recovered",
          "Lease losses", "Attempt duration percentiles", "In flight", "Worker Redis readiness",
          "Maintenance age", "Event loop lag", "Operator poll errors", "Desired replicas", "Stalls by cause"}


# --------------------------------------------------------------------------
# The checker and the exported names


def promql_binary() -> Path:
    env = os.environ.get("EFFECTMQ_PROMQL_BIN")
    if env:
        path = Path(env)
        if not (path.is_file() and os.access(path, os.X_OK)):
            unavailable(f"EFFECTMQ_PROMQL_BIN={env} is not an executable file. Build it with `{PROMQL_BUILD}`.")
        return path.resolve()
    cache = Path(os.environ.get("EFFECTMQ_CACHE") or Path.home() / ".cache" / "effectmq") / "promql" / "current"
    if not os.access(cache, os.X_OK):
        unavailable(f"the promql checker is not built (no {cache}). Build it with `{PROMQL_BUILD}` "
                    f"or point EFFECTMQ_PROMQL_BIN at the binary.")
    return cache.resolve()


# Imports both registries' modules in a fresh interpreter, gives every labelled
# metric one child (a labelled metric without children exposes no sample), serves
# them with the worker's own metrics server and scrapes /metrics over HTTP: the
# names are what Prometheus would really see, suffixes (_total, _bucket, ...) included.
SCRAPE = textwrap.dedent("""
    import json, urllib.request
    from prometheus_client.metrics import MetricWrapperBase
    from prometheus_client.parser import text_string_to_metric_families
    import effectmq.worker.metrics as worker_metrics
    import effectmq_operator.metrics as operator_metrics

    for module in (worker_metrics, operator_metrics):
        for value in vars(module).values():
            if isinstance(value, MetricWrapperBase) and value._labelnames:
                value.labels(*["x"] * len(value._labelnames))
    server = worker_metrics.start_server(0, "127.0.0.1")
    url = "http://127.0.0.1:%d/metrics" % server.server_address[1]
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    print(json.dumps(sorted(n for n in names if n.startswith("effectmq_"))))
""")


@pytest.fixture(scope="module")
def exported_names() -> list[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "operator")])}
    out = subprocess.run([sys.executable, "-c", SCRAPE], capture_output=True, text=True, env=env, timeout=60,
                         check=True, cwd=ROOT).stdout
    return json.loads(out)


@pytest.fixture(scope="module")
def names_file(exported_names, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("promql") / "metrics.txt"
    path.write_text("\n".join(exported_names) + "\n")
    return path


@pytest.fixture(scope="module")
def promql(names_file):
    """promql(command, file=None, stdin=None) -> (exit code, report)."""
    binary = promql_binary()

    def run(command: str, path: Path | None = None, stdin: str | None = None) -> tuple[int, dict]:
        names = [] if command == "monitors" else ["--metrics", str(names_file)]
        argv = [str(binary), command, *names] + ([str(path)] if path else [])
        result = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=60)
        assert result.returncode in (0, 1), f"{argv} exited {result.returncode}: {result.stderr}"
        return result.returncode, json.loads(result.stdout)

    return run


def rule_file(rule: dict, tmp_path: Path) -> Path:
    """A PrometheusRule's spec is a Prometheus rule file (groups: ...), as
    prometheus-operator writes it for Prometheus to load."""
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"], sort_keys=False))
    return path


def by_component(objects: list[dict], kind: str, component: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind
            and o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component]


# --------------------------------------------------------------------------
# Off by default, on and linted


def test_every_optional_part_is_off_by_default(kube_control_plane):
    objects = render(kube_control_plane, "obs")
    assert not [o for o in objects if o["kind"] in MONITORING_KINDS]
    assert not by_component(objects, "Deployment", "dashboard") and not by_component(objects, "Service", "dashboard")
    assert not [o for o in objects if o["kind"] == "ConfigMap" and "grafana_dashboard" in o["metadata"]["labels"]]


def test_helm_lint_and_template_with_every_optional_part_on(kube_control_plane):
    for extra in ([], WITH_ACTIONS, ["--set", "watchNamespaces={shop,billing}"]):
        result = kube_control_plane.helm("lint", str(CHART), "--strict", *ALL_ON, *extra)
        assert "0 chart(s) failed" in result.stdout, result.stdout + result.stderr
    objects = render(kube_control_plane, "obs", *ALL_ON, *WITH_ACTIONS)
    for kind in MONITORING_KINDS:
        find(objects, kind)
    assert len(by_component(objects, "Deployment", "dashboard")) == 1
    assert len(by_component(objects, "Service", "dashboard")) == 1
    find(objects, "ConfigMap", f"{RELEASE}-effectmq-grafana-dashboard")


def test_the_kubernetes_objects_pass_a_server_side_dry_run_under_the_restricted_profile(kube_control_plane,
                                                                                        make_namespace):
    """The dashboard pod is admitted by a namespace that enforces Pod Security
    `restricted`; the Deployment, Service and ConfigMap pass the API server's
    validation (the monitoring kinds need prometheus-operator's CRDs: checked below
    by Prometheus' and Grafana's own code instead)."""
    plane = kube_control_plane
    namespace = make_namespace("obs", {"pod-security.kubernetes.io/enforce": "restricted",
                                       "pod-security.kubernetes.io/enforce-version": "latest"})
    objects = [o for o in render(plane, namespace, *ALL_ON, *WITH_ACTIONS) if o["kind"] not in MONITORING_KINDS]
    dashboard = by_component(objects, "Deployment", "dashboard")[0]
    checked = [dashboard, *by_component(objects, "Service", "dashboard"),
               find(objects, "ConfigMap", f"{RELEASE}-effectmq-grafana-dashboard")]
    result = plane.kubectl("apply", "--dry-run=server", "-f", "-", "-o", "name",
                           input="\n---\n".join(json.dumps(o) for o in checked))
    assert len(result.stdout.split()) == 3, result.stdout
    template = dashboard["spec"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "dashboard", "namespace": namespace, "labels": template["metadata"]["labels"]},
           "spec": template["spec"]}
    plane.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(pod))
    weakened = copy.deepcopy(pod)
    weakened["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    refused = plane.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(weakened), check=False)
    assert refused.returncode != 0 and "violates PodSecurity" in refused.stderr, refused.stderr


# --------------------------------------------------------------------------
# The dashboard Deployment


def dashboard_container(plane, *args: str) -> tuple[dict, dict]:
    objects = render(plane, "obs", "--set", "dashboard.enabled=true", *args)
    deployment = by_component(objects, "Deployment", "dashboard")[0]
    return deployment, deployment["spec"]["template"]["spec"]["containers"][0]


def test_dashboard_runs_restricted_read_only_with_probes(kube_control_plane):
    deployment, container = dashboard_container(kube_control_plane, "--set", "redis.enabled=true")
    pod = deployment["spec"]["template"]["spec"]
    assert container["securityContext"] == {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
                                            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
                                            "seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False  # it never calls the Kubernetes API
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]  # writable /tmp, read-only root
    argv = container["command"] + container["args"]
    assert argv[:2] == ["effectmq", "dashboard"]
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    assert "--actions" not in argv and "--token-file" not in argv
    assert "--url" not in argv  # the URL (maybe with a password) stays out of the command line
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]
    assert argv[argv.index("--port") + 1] == str(port)
    env = {e["name"]: e for e in container["env"]}
    # the bundled Redis's URL, password included, from its Secret: a mounted file, never the value
    assert_redis_url_from_secret_file(pod, f"{RELEASE}-effectmq-redis", "url")
    assert "EFFECTMQ_DASHBOARD_TOKEN" not in env
    # the image is the operator's, which installs the dashboard extra: every requirement of
    # it pinned in the lock the Dockerfile installs (operator/requirements.lock, since 5c60727)
    assert container["image"] == "effectmq-operator:0.1.0"
    dockerfile = (ROOT / "operator" / "Dockerfile").read_text()
    assert re.search(r"pip install .*--require-hashes .*-r requirements\.lock", dockerfile)
    locked = set(re.findall(r"^([A-Za-z0-9_.-]+)==", (ROOT / "operator" / "requirements.lock").read_text(), re.M))
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dashboard"]
    wanted = {re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower() for requirement in extra}
    assert wanted and wanted <= {name.lower() for name in locked}, wanted - locked


def test_dashboard_service_selects_the_dashboard_pods(kube_control_plane):
    objects = render(kube_control_plane, "obs", *ALL_ON)
    service = by_component(objects, "Service", "dashboard")[0]
    deployment = by_component(objects, "Deployment", "dashboard")[0]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    # and no other Service of the chart selects them (the operator's is component=operator)
    others = [s for s in objects if s["kind"] == "Service" and s is not service]
    assert all(not (s["spec"].get("selector") or {}).items() <= labels.items() for s in others)


def test_dashboard_reads_the_redis_url_from_a_secret_and_shows_the_queues_given(kube_control_plane):
    deployment, container = dashboard_container(kube_control_plane, "--set", "dashboard.redis.existingSecret=redis-url",
                                                "--set", "dashboard.queues={shop/emails,billing/invoices}")
    assert_redis_url_from_secret_file(deployment["spec"]["template"]["spec"], "redis-url", "url")
    args = container["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--queue"] == ["shop/emails", "billing/invoices"]


def test_dashboard_without_a_redis_is_a_clear_template_failure(kube_control_plane):
    result = helm_template(kube_control_plane, "obs", "--set", "dashboard.enabled=true", check=False)
    assert result.returncode != 0
    assert "dashboard.enabled needs a Redis" in result.stderr and "dashboard.redis.existingSecret" in result.stderr


def test_dashboard_refuses_a_redis_url_with_credentials_in_values(kube_control_plane):
    result = helm_template(kube_control_plane, "obs", "--set", "dashboard.enabled=true",
                           "--set", "dashboard.redis.url=redis://:hunter2@redis:6379/0", check=False)
    assert result.returncode != 0 and "/dashboard/redis/url" in result.stderr, result.stderr


def test_actions_need_the_token_secret(kube_control_plane):
    result = helm_template(kube_control_plane, "obs", "--set", "dashboard.enabled=true", "--set", "redis.enabled=true",
                           "--set", "dashboard.actions.enabled=true", check=False)
    assert result.returncode != 0
    assert "dashboard.actions.enabled needs dashboard.actions.existingSecret" in result.stderr, result.stderr


def test_actions_take_the_token_from_the_existing_secret_as_a_file(kube_control_plane):
    deployment, container = dashboard_container(kube_control_plane, "--set", "redis.enabled=true", *WITH_ACTIONS,
                                                "--set", "dashboard.actions.existingSecretKey=secret-token")
    args = container["args"]
    assert "--actions" in args
    token_path = args[args.index("--token-file") + 1]
    mount = {m["name"]: m for m in container["volumeMounts"]}["token"]
    assert mount["readOnly"] is True and token_path == f"{mount['mountPath']}/token"
    volume = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}["token"]
    assert volume["secret"] == {"secretName": "dash-token", "items": [{"key": "secret-token", "path": "token"}]}
    # the token never sits in the pod spec or the environment
    assert "EFFECTMQ_DASHBOARD_TOKEN" not in {e["name"] for e in container["env"]}


def test_install_notes_tell_how_to_open_the_dashboard(kube_control_plane, make_namespace):
    namespace = make_namespace("obs")
    out = kube_control_plane.helm("install", RELEASE, str(CHART), "-n", namespace, "--dry-run=server",
                                  "--set", "dashboard.enabled=true", "--set", "redis.enabled=true").stdout
    notes = out[out.index("NOTES:"):]
    assert f"port-forward svc/{RELEASE}-effectmq-dashboard 8080:8080" in notes and "read-only" in notes, notes
    out = kube_control_plane.helm("install", RELEASE, str(CHART), "-n", namespace, "--dry-run=server").stdout
    assert "dashboard" not in out[out.index("NOTES:"):]


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def test_dashboard_runs_with_the_charts_command_environment_and_token_mount(make_redis, kube_control_plane,
                                                                            tmp_path):
    """`effectmq dashboard` started exactly as the chart's Deployment starts it, with
    this test in the kubelet's place: the Redis URL Secret (a URL with a password) and
    the token Secret mounted where the pod spec mounts them. Only the
    listen port and the mount's root are moved. It comes up ready, with actions on,
    and its overview shows no password."""
    password = "planted-S3cret-pw"
    server = make_redis(password=password)
    deployment, container = dashboard_container(
        kube_control_plane, "--set", "dashboard.redis.existingSecret=redis-url", *WITH_ACTIONS,
        "--set", "dashboard.queues={shop/emails}")
    secrets = {("redis-url", "url"): server.url, ("dash-token", "token"): "t0ken-" + "x" * 20}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    args = list(container["args"])
    moved = {}  # mount path -> where this test put the Secret's files
    for mount in container["volumeMounts"]:
        secret = volumes[mount["name"]].get("secret")
        if not secret:
            continue
        root = tmp_path / mount["name"]
        root.mkdir()
        for item in secret["items"]:
            (root / item["path"]).write_text(secrets[(secret["secretName"], item["key"])] + "\n")
        moved[mount["mountPath"]] = str(root)

    def relocated(value: str) -> str:
        for path, root in moved.items():
            if value.startswith(path + "/"):
                return root + value[len(path):]
        return value

    args = [relocated(a) for a in args]
    env = {}
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = relocated(var["value"])
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = secrets[(ref["name"], ref["key"])]
    assert "EFFECTMQ_REDIS_URL" not in env and env["EFFECTMQ_REDIS_URL_FILE"].startswith(str(tmp_path))
    port = free_port()
    args[args.index("--port") + 1] = str(port)
    assert container["command"] == ["effectmq", "dashboard"] and "--actions" in args
    log = tmp_path / "dashboard.log"
    full_env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "operator")]),
                "PYTHONUNBUFFERED": "1"}
    full_env.pop("EFFECTMQ_DASHBOARD_TOKEN", None)
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "effectmq", "dashboard", *args], env=full_env, cwd=tmp_path,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        def ready() -> bool:
            assert proc.poll() is None, f"the dashboard exited with {proc.returncode}:\n{log.read_text()}"
            return http_get(f"http://127.0.0.1:{port}/readyz")[0] == 200
        wait_for(ready, timeout=30, what=f"dashboard /readyz\n{log.read_text() if log.exists() else ''}")
        assert http_get(f"http://127.0.0.1:{port}/healthz")[0] == 200
        status, page = http_get(f"http://127.0.0.1:{port}/")
        assert status == 200 and "shop/emails" in page
        assert password not in page and password not in log.read_text()
    finally:
        stop_process(proc, 20)


# --------------------------------------------------------------------------
# Scraping: ServiceMonitor (operator) and PodMonitor (workers)


def test_service_monitor_scrapes_the_operator_service(kube_control_plane):
    objects = render(kube_control_plane, "obs", *ALL_ON)
    monitor = find(objects, "ServiceMonitor")
    service = find(objects, "Service", f"{RELEASE}-effectmq")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["obs"]}
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    assert "metrics" in [p["name"] for p in service["spec"]["ports"]]
    # only the operator's Service matches (the dashboard's has no metrics)
    matching = [s for s in objects if s["kind"] == "Service"
                and monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    assert matching == [service]


def test_pod_monitor_selects_the_worker_pods_the_operator_builds(kube_control_plane):
    from effectmq_operator import builders
    from effectmq_operator.spec import QueueSpec

    spec = QueueSpec.parse({"redis": {"url": "redis://r:6379/0"},
                                    "worker": {"image": "shop:1", "handlers": "shop.tasks:app"}})
    worker = builders.worker_deployment("shop", "emails", spec, replicas=1)
    pod_labels = worker["spec"]["template"]["metadata"]["labels"]
    container = worker["spec"]["template"]["spec"]["containers"][0]

    objects = render(kube_control_plane, "obs", *ALL_ON)
    monitor = find(objects, "PodMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in [p["name"] for p in container["ports"]]
    namespaced = find(render(kube_control_plane, "obs", *ALL_ON, "--set", "watchNamespaces={shop,billing}"),
                      "PodMonitor")
    assert namespaced["spec"]["namespaceSelector"] == {"matchNames": ["shop", "billing"]}


def test_monitoring_objects_decode_into_prometheus_operators_types(promql, kube_control_plane, tmp_path):
    """prometheus-operator's CRDs are not installed in the test API server; its own
    Go types (pkg/apis/monitoring/v1) decode the objects strictly instead, so a
    misspelt or misplaced field fails (the API server would prune it silently)."""
    objects = [o for o in render(kube_control_plane, "obs", *ALL_ON) if o["kind"] in MONITORING_KINDS]
    path = tmp_path / "monitors.json"
    path.write_text(json.dumps(objects))
    code, report = promql("monitors", path)
    assert code == 0 and report["problems"] == [], report["problems"]
    assert sorted(o["kind"] for o in report["objects"]) == sorted(MONITORING_KINDS)
    planted = copy.deepcopy(objects)
    find(planted, "PodMonitor")["spec"]["podMetricsEndpoints"][0]["intervall"] = "30s"
    path.write_text(json.dumps(planted))
    code, report = promql("monitors", path)
    assert code == 1 and any('unknown field "intervall"' in p for p in report["problems"]), report["problems"]


# --------------------------------------------------------------------------
# The exported names


def test_exported_names_come_from_a_real_scrape(exported_names):
    names = set(exported_names)
    # prometheus_client's suffixes, as scraped: counters _total, histograms _bucket/_sum/_count
    assert {"effectmq_attempts_total", "effectmq_handler_duration_seconds_bucket",
            "effectmq_handler_duration_seconds_count", "effectmq_operator_poll_errors_total",
            "effectmq_operator_accepting_tasks",
            "effectmq_queue_depth", "effectmq_operator_backlog"} <= names
    assert "effectmq_attempts" not in names and "effectmq_handler_duration_seconds" not in names


# --------------------------------------------------------------------------
# Grafana


def test_grafana_configmap_carries_the_dashboard_json_as_is(kube_control_plane):
    objects = render(kube_control_plane, "obs", "--set", "grafana.dashboard.enabled=true",
                     "--set", "grafana.dashboard.annotations.grafana_folder=EffectMQ")
    config = find(objects, "ConfigMap", f"{RELEASE}-effectmq-grafana-dashboard")
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config["metadata"]["annotations"] == {"grafana_folder": "EffectMQ"}
    assert json.loads(config["data"]["effectmq.json"]) == json.loads(DASHBOARD_JSON.read_text())
    assert "{{queue}}" in config["data"]["effectmq.json"]  # Grafana's legend templates, untouched by Helm
    assert len(json.dumps(config)) < 1024 * 1024  # a ConfigMap holds at most 1 MiB


def test_grafana_dashboard_is_valid_against_grafanas_model(promql, kube_control_plane, tmp_path):
    # the JSON as the ConfigMap delivers it
    config = find(render(kube_control_plane, "obs", "--set", "grafana.dashboard.enabled=true"), "ConfigMap",
                  f"{RELEASE}-effectmq-grafana-dashboard")
    path = tmp_path / "effectmq.json"
    path.write_text(config["data"]["effectmq.json"])
    code, report = promql("dashboard", path)
    assert code == 0 and report["problems"] == [], "\n".join(report["problems"])
    dashboard = report["dashboard"]
    variables = {v["name"]: v for v in dashboard["variables"]}
    assert variables["datasource"] == {"name": "datasource", "type": "datasource", "query": "prometheus"}
    assert variables["queue"]["type"] == "query" and "label_values(" in variables["queue"]["query"]
    titles = [p["title"] for p in dashboard["panels"]]
    assert PANELS <= set(titles), f"missing panels: {PANELS - set(titles)}"
    assert len(titles) == len(set(titles))
    # every query follows the queue variable, but the operator-wide reconcile age
    for panel in dashboard["panels"]:
        for expr in panel["targets"]:
            if "effectmq_operator_oldest_reconcile_age_seconds" not in expr:
                assert 'queue=~"$queue"' in expr, f"{panel['title']}: {expr}"
    # the exprs checked are the targets plus the queue variable's selector
    targets = sum(len(p["targets"]) for p in dashboard["panels"])
    assert len(report["expressions"]) == targets + 1


# --------------------------------------------------------------------------
# The PrometheusRule


def test_prometheus_rule_loads_in_prometheus_with_the_alerts_users_expect(promql, kube_control_plane, tmp_path):
    rule = find(render(kube_control_plane, "obs", "--set", "prometheusRule.enabled=true"), "PrometheusRule")
    code, report = promql("rules", rule_file(rule, tmp_path))
    assert code == 0 and report["problems"] == [], "\n".join(report["problems"])
    rules = {r["alert"]: r for r in report["rules"]}
    assert set(rules) == ALERTS
    for name, r in rules.items():
        assert r["for"] not in ("", "0s"), f"{name} has no for:"
        assert r["labels"]["severity"] in ("warning", "critical"), name
        assert r["annotations"]["summary"] and r["annotations"]["description"], name
        # each names what it is about: a queue, or the operator pod for the operator's own health
        about = "{{ $labels.pod }}" if name in OPERATOR_ALERTS else "{{ $labels.queue }}"
        assert about in r["annotations"]["summary"], name
    assert len(report["expressions"]) == len(ALERTS)


def test_stalls_clustering_alert_fires_where_the_queue_condition_turns_stalling(promql, kube_control_plane,
                                                                                tmp_path):
    """EffectMQStallsClustering counts a queue's stalls of one cause over the window and
    the count with which the operator sets a Queue's Stalling condition (stalls.py; the
    condition counts every cause and names the dominant one), so the alert and `kubectl
    describe queue` tell the same story."""
    from effectmq_operator import stalls

    rule = find(render(kube_control_plane, "obs", "--set", "prometheusRule.enabled=true"), "PrometheusRule")
    code, report = promql("rules", rule_file(rule, tmp_path))
    assert code == 0, report["problems"]
    alert = {r["alert"]: r for r in report["rules"]}["EffectMQStallsClustering"]
    assert alert["expr"] == (f"sum by (queue, cause) (increase(effectmq_stalls_total[{stalls.WINDOW_SECONDS // 60}m]))"
                             f" >= {stalls.CLUSTER}"), alert["expr"]
    assert "{{ $labels.cause }}" in alert["annotations"]["summary"]
    assert "worker.resources.limits.memory" in alert["annotations"]["description"]


def test_alert_thresholds_windows_and_severities_are_values(promql, kube_control_plane, tmp_path):
    args = ["--set", "prometheusRule.enabled=true",
            "--set", "prometheusRule.alerts.oldestWaiting.seconds=123",
            "--set", "prometheusRule.alerts.oldestWaiting.for=3m",
            "--set", "prometheusRule.alerts.oldestWaiting.severity=critical",
            "--set-json", "prometheusRule.alerts.stallRate.perMinute=2.5",  # --set makes 2.5 a string
            "--set", "prometheusRule.alerts.stallRate.window=20m",
            "--set", "prometheusRule.alerts.deadLettersGrowing.increase=7",
            "--set", "prometheusRule.alerts.stallsClustering.stalls=5",
            "--set", "prometheusRule.alerts.stallsClustering.window=30m",
            "--set", "prometheusRule.alerts.maintenanceLagging.enabled=false",
            "--set", "prometheusRule.additionalLabels.team=payments"]
    rule = find(render(kube_control_plane, "obs", *args), "PrometheusRule")
    code, report = promql("rules", rule_file(rule, tmp_path))
    assert code == 0, report["problems"]
    rules = {r["alert"]: r for r in report["rules"]}
    assert set(rules) == ALERTS - {"EffectMQMaintenanceLagging"}
    oldest = rules["EffectMQOldestWaitingHigh"]
    assert oldest["expr"].endswith("> 123") and oldest["for"] == "3m" and oldest["labels"]["severity"] == "critical"
    assert rules["EffectMQStallRateHigh"]["expr"].endswith("> 2.5")
    assert "[20m]" in rules["EffectMQStallRateHigh"]["expr"]
    assert rules["EffectMQDeadLettersGrowing"]["expr"].endswith("> 7")
    assert rules["EffectMQStallsClustering"]["expr"].endswith("[30m])) >= 5")
    assert all(r["labels"]["team"] == "payments" for r in rules.values())


def test_the_schema_refuses_a_bad_alert_duration(kube_control_plane):
    result = helm_template(kube_control_plane, "obs", "--set", "prometheusRule.enabled=true",
                           "--set", "prometheusRule.alerts.stallRate.window=ten minutes", check=False)
    assert result.returncode != 0 and "/prometheusRule/alerts/stallRate/window" in result.stderr, result.stderr
    result = helm_template(kube_control_plane, "obs", "--set", "prometheusRule.enabled=true",
                           "--set", "prometheusRule.alerts.stallsClustering.stalls=0", check=False)
    assert result.returncode != 0 and "/prometheusRule/alerts/stallsClustering/stalls" in result.stderr, result.stderr


# --------------------------------------------------------------------------
# The checker's self-test: it must fail on what it is there to catch


def test_checker_refuses_a_bad_expression_and_an_unknown_metric(promql):
    code, report = promql("exprs", stdin="sum(rate(effectmq_attempts_total[5m]))\n")
    assert code == 0 and report["expressions"][0]["metrics"] == ["effectmq_attempts_total"]
    code, report = promql("exprs", stdin="sum(rate(effectmq_attempts_total[5m])\n")
    assert code == 1 and "does not parse" in report["problems"][0]
    code, report = promql("exprs", stdin="rate(effectmq_attempts[5m])\n")  # the name without _total
    assert code == 1 and "names effectmq_attempts, which the project does not export" in report["problems"][0]
    code, report = promql("exprs", stdin='sum({__name__=~"effectmq_.+"})\n')
    assert code == 1 and "name them literally" in report["problems"][0]


def test_checker_refuses_planted_faults_in_the_rule(promql, kube_control_plane, tmp_path):
    rule = find(render(kube_control_plane, "obs", "--set", "prometheusRule.enabled=true"), "PrometheusRule")
    plants = {
        "expr": ("max by (queue) (effectmq_oldest_waiting_seconds > 300", "does not parse"),
        "unknown": ("max by (queue) (effectmq_oldest_waiting) > 300", "names effectmq_oldest_waiting"),
        "for": ("ten minutes", "rule file"),
        "template": ("{{ $labels.queue ", "rule file"),
    }
    for what, (value, message) in plants.items():
        planted = copy.deepcopy(rule)
        alert = planted["spec"]["groups"][0]["rules"][0]
        if what == "for":
            alert["for"] = value
        elif what == "template":
            alert["annotations"]["summary"] = value
        else:
            alert["expr"] = value
        code, report = promql("rules", rule_file(planted, tmp_path))
        assert code == 1 and any(message in p for p in report["problems"]), (what, report["problems"])


def test_checker_refuses_planted_faults_in_the_grafana_dashboard(promql, tmp_path):
    original = json.loads(DASHBOARD_JSON.read_text())
    first = next(i for i, p in enumerate(original["panels"]) if p["type"] == "timeseries")

    def planted(change) -> list[str]:
        dashboard = copy.deepcopy(original)
        change(dashboard, dashboard["panels"][first])
        path = tmp_path / "planted.json"
        path.write_text(json.dumps(dashboard))
        code, report = promql("dashboard", path)
        assert code == 1, "the planted fault went through"
        return report["problems"]

    def set_(key, value):
        return lambda d, p: p["targets"][0].__setitem__(key, value)

    assert any("does not parse" in m for m in planted(set_("expr", "rate(effectmq_attempts_total[5m]")))
    assert any("names effectmq_nope_total" in m for m in planted(set_("expr", "rate(effectmq_nope_total[5m])")))
    assert any("$nosuchvar" in m for m in planted(set_("expr", 'effectmq_in_flight{queue=~"$nosuchvar"}')))
    # an unknown field anywhere in Grafana's model (here in a Prometheus target, a panel's options)
    assert any("exprr" in m for m in planted(set_("exprr", "up")))
    assert any("legendd" in m for m in planted(lambda d, p: p["options"].__setitem__("legendd", {})))
    assert any("refId" in m for m in planted(set_("refId", 7)))
    # a hard-coded data source instead of the datasource variable
    assert any("datasource variable" in m for m in planted(lambda d, p: p.__setitem__(
        "datasource", {"type": "prometheus", "uid": "prod-prometheus"})))
    assert any("no datasource variable" in m for m in planted(
        lambda d, p: d["templating"].__setitem__("list", [v for v in d["templating"]["list"]
                                                          if v["type"] != "datasource"])))
