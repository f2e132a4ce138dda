import pytest

from tests.support.operator import OperatorProcess


@pytest.fixture
def start_operator(kube_control_plane, kube_namespace, effectmq_crds, tmp_path):
    started: list[OperatorProcess] = []

    def start(name: str = "operator", **kwargs) -> OperatorProcess:
        op = OperatorProcess(kube_control_plane, kube_namespace, tmp_path, name=name, **kwargs)
        started.append(op)
        return op

    yield start
    for op in started:
        op.stop()
        # pytest shows a teardown's output only when the test failed: what the operator did
        print(f"--- the end of {op.log_path.name} ---\n{op.log()}")
