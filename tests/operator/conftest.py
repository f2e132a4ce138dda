import pytest

from tests.support.operator import OperatorProcess

# What the teardown shows of a failed test's operator: its loops' progress
DIAGNOSTIC_METRICS = ("effectmq_operator_reconciles_total", "effectmq_operator_oldest_reconcile_age_seconds",
                      "effectmq_operator_api_requests_total", "effectmq_operator_poll_errors_total")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)  # the fixture's teardown reads whether the test failed


def resource_states(plane, namespace: str) -> str:
    """Each Queue's and Schedule's conditions, a line each: what the operator last wrote."""
    lines = []
    for kind in ("queues", "schedules"):
        for item in plane.kubectl_json("get", kind, "-n", namespace)["items"]:
            conditions = ((item.get("status") or {}).get("conditions")) or []
            shown = " ".join(f"{c['type']}={c['status']}/{c.get('reason')}" for c in conditions) or "(no status)"
            lines.append(f"{kind[:-1]} {item['metadata']['name']}: {shown}")
    return "\n".join(lines) or "(none)"


def operator_progress(op: OperatorProcess) -> str:
    try:
        text = op.metrics()
    except OSError as exc:
        return f"(metrics unreadable: {exc})"
    return "\n".join(line for line in text.splitlines() if line.startswith(DIAGNOSTIC_METRICS))


@pytest.fixture
def start_operator(request, kube_control_plane, kube_namespace, effectmq_crds, tmp_path):
    started: list[OperatorProcess] = []

    def start(name: str = "operator", **kwargs) -> OperatorProcess:
        op = OperatorProcess(kube_control_plane, kube_namespace, tmp_path, name=name, **kwargs)
        started.append(op)
        return op

    yield start
    failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
    if failed and started:
        # pytest shows a teardown's output only when the test failed
        try:
            print(f"--- the resources' conditions ---\n{resource_states(kube_control_plane, kube_namespace)}")
        except Exception as exc:  # a diagnostic must not hide the failure
            print(f"(conditions unreadable: {exc})")
    for op in started:
        progress = operator_progress(op) if failed else ""
        op.stop()
        print(f"--- the end of {op.log_path.name} ---\n{op.log()}")
        if progress:
            print(f"--- {op.log_path.name}'s progress ---\n{progress}")
