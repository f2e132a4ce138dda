"""The systems the tests and the developer tools bring up on this machine, without pytest.

- ``controlplane``: etcd, kube-apiserver and kube-controller-manager on free ports
  (:class:`~tooling.testbed.controlplane.KubeControlPlane`).
- ``cluster``: that control plane plus one node whose pods really run
  (:class:`~tooling.testbed.cluster.OneNodeCluster`), and the command line of
  ``tooling/cluster.sh`` (``python -m tooling.testbed.cluster up|down|status``).
- ``oci``: the single-binary image archive of the node's pod sandbox.

``tests/fixtures`` wraps them as pytest fixtures; where a piece is missing these raise
:class:`Unavailable`, which the fixtures turn into a skip (a failure under ``CI=true``).
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


class Unavailable(RuntimeError):
    """A binary or a privilege the system needs is missing on this machine."""


def cache_dir() -> Path:
    """Where the build scripts under tooling/ put what they build (per machine)."""
    return Path(os.environ.get("EFFECTMQ_CACHE") or Path.home() / ".cache" / "effectmq")
