#!/usr/bin/env python3
"""Write what follows from the settings table (effectmq/protocol/settings.py): the Queue CRD's
defaults, bounds and descriptions (crds/queue.yaml and the chart's copy) and the
reference page docs/settings.md.

    python tooling/sync_settings.py          # write
    python tooling/sync_settings.py --check  # exit 1 if a file differs (what the test asserts)

Writing keeps the CRD's layout and comments (ruamel.yaml round trip; `pip install
ruamel.yaml` if it is missing). `--check` needs only PyYAML.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from effectmq.protocol import settings  # noqa: E402
from tooling import generated  # noqa: E402
from tooling.generated import folded, round_trip_yaml  # noqa: E402
from effectmq.protocol.settings import Kind, Setting  # noqa: E402

CRDS = (ROOT / "crds/queue.yaml", ROOT / "charts/effectmq/crds/queue.yaml")
DOC = ROOT / "docs/settings.md"


def schema_fields(setting: Setting) -> dict[str, Any]:
    """What the CRD schema of one field says, as the table has it."""
    out: dict[str, Any] = {"description": setting.description}
    if setting.default is not None and setting.kind is not Kind.RETRY:
        default = setting.default
        if setting.kind in (Kind.SECONDS, Kind.RETENTION):  # the resource counts whole seconds
            if default != int(default):
                raise ValueError(f"{setting.field}: a Queue resource takes whole seconds, the default is {default}")
            default = int(default)
        # `kubectl explain` shows no schema default: the description says it, as core types' do
        shown = str(default).lower() if isinstance(default, bool) else default
        if setting.field_default:
            out["default"] = default
            out["description"] = f"{setting.description} Default: {shown}."
        else:
            out["description"] = f"{setting.description} Unset: the runtime's default, {shown}."
    if setting.kind is not Kind.FLAG and setting.kind is not Kind.ENUM:
        if setting.resource_minimum is not None:
            out["minimum"] = settings.resource_minima()[setting.field]
        if setting.field in settings.resource_maxima():
            out["maximum"] = settings.resource_maxima()[setting.field]
    return out


def spec_schema(crd: Any) -> Any:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def field_schema(spec: Any, path: str) -> Any:
    node = spec
    for part in path.split("."):
        node = node["properties"][part]
    return node


def differences(crd: Any) -> list[str]:
    """Where a loaded CRD disagrees with the table (empty: in sync)."""
    out = []
    spec = spec_schema(crd)
    for setting in settings.TABLE:
        if setting.field is None:
            continue
        node = field_schema(spec, setting.field)
        for key, want in schema_fields(setting).items():
            if node.get(key) != want:
                out.append(f"spec.{setting.field}.{key}: the CRD has {node.get(key)!r}, the table {want!r}")
        if not setting.field_default and "default" in node:
            out.append(f"spec.{setting.field}.default: the table leaves it unset")
    return out


def _shown(setting: Setting) -> str:
    value = setting.default
    if value is None:
        return "the runtime's" if setting.kind is Kind.RETRY else ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"{value} {setting.unit}".strip() if setting.unit == "s" else str(value)


def _bounds(setting: Setting) -> str:
    if setting.kind in (Kind.FLAG, Kind.RETRY, Kind.RATE):
        return ""
    if setting.kind is Kind.ENUM:
        return " \\| ".join(setting.choices)
    low = "" if setting.minimum is None else f"{setting.minimum:g}"
    high = "" if setting.maximum is None else f"{setting.maximum:g}"
    return f"{low} … {high}".strip(" …") if high else f"≥ {low}"


def render_doc() -> str:
    lines = [
        "# Queue settings",
        "",
        ("<!-- Written by `python tooling/sync_settings.py` from effectmq/protocol/settings.py: "
         "edit the table there. -->"),
        "",
        "Every setting of a queue, as Python (`TaskQueue(...)`, `q.configure(...)`, the worker) and a Queue",
        "resource (`spec.<field>`) name it. Settings with a Redis field live in the queue's meta hash, so a",
        "change (`q.configure(...)`, or the operator applying a Queue) reaches running producers, workers and",
        "scripts without a redeploy. `configure(name=None)` resets one to its default.",
        "",
        "| Python | Queue field | default | bounds | Redis field | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for s in settings.TABLE:
        cells = [f"`{s.name}`" if s.name else "", f"`{s.field}`" if s.field else "", _shown(s), _bounds(s),
                 f"`{s.redis}`" if s.redis else "", s.description.replace("|", "\\|")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Durations are seconds; Redis keeps them in milliseconds (`*_ms`). A retention of -1 (Python:",
              "`None`) keeps records forever. Counts are bounded by 2^31 − 1, the CRD's integer.", ""]
    return "\n".join(lines)


def write() -> None:
    yaml = round_trip_yaml()
    for path in CRDS:
        docs = list(yaml.load_all(path.read_text()))
        spec = spec_schema(docs[0])
        for setting in settings.TABLE:
            if setting.field is None:
                continue
            node = field_schema(spec, setting.field)
            for key, want in schema_fields(setting).items():
                if node.get(key) == want:
                    continue  # unchanged: keeps its layout
                if key == "description":
                    want = folded(want)
                if key in node:
                    node[key] = want
                else:  # before the field's properties, after its type and bounds
                    at = list(node).index("properties") if "properties" in node else len(node)
                    node.insert(at, key, want)
            if not setting.field_default:
                node.pop("default", None)
        out = io.StringIO()
        yaml.dump_all(docs, out)
        path.write_text(out.getvalue())
    DOC.write_text(render_doc())


def check() -> list[str]:
    import yaml

    problems = []
    for path in CRDS:
        problems += [f"{path.relative_to(ROOT)}: {d}" for d in differences(yaml.safe_load(path.read_text()))]
    if not DOC.exists() or DOC.read_text() != render_doc():
        problems.append(f"{DOC.relative_to(ROOT)} is not what the table gives")
    return problems


if __name__ == "__main__":
    sys.exit(generated.main(__doc__, check, write, "python tooling/sync_settings.py"))
