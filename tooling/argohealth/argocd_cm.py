#!/usr/bin/env python3
"""Write gitops/argocd/argocd-cm.yaml, the argocd-cm keys of EffectMQ's Argo CD
health check, from the script gitops/argocd/health.lua.

    python tooling/argohealth/argocd_cm.py          # write
    python tooling/argohealth/argocd_cm.py --check  # exit 1 if the file differs (what the test asserts)

Standard library only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
SCRIPT = ROOT / "gitops" / "argocd" / "health.lua"
CONFIGMAP = ROOT / "gitops" / "argocd" / "argocd-cm.yaml"
KINDS = ("Queue", "Schedule")  # one script serves both
GROUP = "effectmq.io"


def health_key(kind: str) -> str:
    """The argocd-cm key Argo CD reads a kind's health script from."""
    return f"resource.customizations.health.{GROUP}_{kind}"


def render(script: str) -> str:
    """The ConfigMap manifest: both keys, each holding the script as a literal block."""
    if not script.endswith("\n") or script.endswith("\n\n"):
        raise ValueError(f"{SCRIPT} must end with exactly one newline (a YAML `|` block keeps one)")
    block = "".join(f"    {line}".rstrip() + "\n" for line in script.splitlines())
    lines = [
        "# EffectMQ's Argo CD health check for Queue and Schedule: merge into Argo CD's",
        "# argocd-cm (docs/gitops.md says how). Generated from gitops/argocd/health.lua",
        "# by `python tooling/argohealth/argocd_cm.py`: edit the script, not this file.",
        "apiVersion: v1",
        "kind: ConfigMap",
        "metadata:",
        "  name: argocd-cm",
        "  labels:",
        "    app.kubernetes.io/part-of: argocd",
        "data:",
    ]
    text = "\n".join(lines) + "\n"
    for kind in KINDS:
        text += f"  {health_key(kind)}: |\n{block}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs instead of writing it")
    args = parser.parse_args(argv)
    wanted = render(SCRIPT.read_text())
    current = CONFIGMAP.read_text() if CONFIGMAP.exists() else None
    if args.check:
        if current != wanted:
            print(f"{CONFIGMAP.relative_to(ROOT)} differs from {SCRIPT.relative_to(ROOT)}: "
                  f"run `python tooling/argohealth/argocd_cm.py`", file=sys.stderr)
            return 1
        return 0
    if current != wanted:
        CONFIGMAP.write_text(wanted)
        print(f"wrote {CONFIGMAP.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
