import uuid

import pytest


@pytest.fixture
def make_namespace(kube_control_plane):
    """Fresh namespaces (beyond kube_namespace), deleted afterwards without waiting."""
    created: list[str] = []

    def make(prefix: str, labels: dict[str, str] | None = None) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        kube_control_plane.kubectl("create", "namespace", name)
        if labels:
            kube_control_plane.kubectl("label", "namespace", name, *[f"{k}={v}" for k, v in labels.items()])
        created.append(name)
        return name

    yield make
    for name in created:
        kube_control_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)
