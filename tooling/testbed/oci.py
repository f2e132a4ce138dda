"""A one-file OCI image archive from a static binary, for the test node's pod sandbox.

No registry serves base images here, so the sandbox ("pause") image is made from a
binary compiled on this machine: one layer holding ``/pause``, an image config whose
entrypoint runs it, written in the OCI image layout that ``ctr images import`` reads.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path


def _blob(data: bytes) -> tuple[str, bytes]:
    return "sha256:" + hashlib.sha256(data).hexdigest(), data


def _add(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    tar.addfile(info, io.BytesIO(data))


def write_single_binary_image(binary: Path, path_in_image: str, ref: str, archive: Path) -> None:
    """Write ``archive``: an OCI image named ``ref`` whose only file is ``binary``."""
    layer_tar = io.BytesIO()
    with tarfile.open(fileobj=layer_tar, mode="w") as tar:
        _add(tar, path_in_image.lstrip("/"), binary.read_bytes(), 0o755)
    diff_id, _ = _blob(layer_tar.getvalue())
    layer_digest, layer = _blob(gzip.compress(layer_tar.getvalue(), mtime=0))
    config_digest, config = _blob(json.dumps({
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": [path_in_image], "User": "65535:65535"},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }).encode())
    manifest_digest, manifest = _blob(json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": config_digest, "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": layer_digest, "size": len(layer)}],
    }).encode())
    index = json.dumps({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest_digest, "size": len(manifest),
            "annotations": {"org.opencontainers.image.ref.name": ref},
        }],
    }).encode()
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w") as tar:
        _add(tar, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        _add(tar, "index.json", index)
        for digest, data in ((layer_digest, layer), (config_digest, config), (manifest_digest, manifest)):
            _add(tar, "blobs/sha256/" + digest.split(":", 1)[1], data)


def write_derived_image(base: Path, files: dict[str, bytes], ref: str, archive: Path) -> None:
    """Write ``archive``: the single image of the OCI archive ``base`` plus one layer
    holding ``files`` (path in the image -> content, read-only for all), named ``ref``.
    Lets a test run its own handler module on the project's worker image without a build."""
    with tarfile.open(base) as src:
        blobs = {m.name: src.extractfile(m).read() for m in src.getmembers()  # type: ignore[union-attr]
                 if m.isfile() and m.name.startswith("blobs/")}
        (entry,) = json.loads(src.extractfile("index.json").read())["manifests"]  # type: ignore[union-attr]

    def blob(digest: str) -> bytes:
        return blobs["blobs/sha256/" + digest.split(":", 1)[1]]

    manifest = json.loads(blob(entry["digest"]))
    config = json.loads(blob(manifest["config"]["digest"]))
    layer_tar = io.BytesIO()
    with tarfile.open(fileobj=layer_tar, mode="w") as tar:
        for path, data in sorted(files.items()):
            _add(tar, path.lstrip("/"), data)
    diff_id, _ = _blob(layer_tar.getvalue())
    layer_digest, layer = _blob(gzip.compress(layer_tar.getvalue(), mtime=0))
    config["rootfs"]["diff_ids"].append(diff_id)
    config.setdefault("history", []).append({"created_by": f"write_derived_image: {', '.join(sorted(files))}"})
    config_digest, config_bytes = _blob(json.dumps(config).encode())
    manifest["config"] = {**manifest["config"], "digest": config_digest, "size": len(config_bytes)}
    manifest["layers"].append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                               "digest": layer_digest, "size": len(layer)})
    manifest.pop("annotations", None)
    manifest_digest, manifest_bytes = _blob(json.dumps(manifest).encode())
    index = json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifest_digest,
        "size": len(manifest_bytes), "annotations": {"org.opencontainers.image.ref.name": ref}}]}).encode()
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w") as tar:
        _add(tar, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        _add(tar, "index.json", index)
        for name, data in blobs.items():
            _add(tar, name, data)
        for digest, data in ((layer_digest, layer), (config_digest, config_bytes), (manifest_digest, manifest_bytes)):
            _add(tar, "blobs/sha256/" + digest.split(":", 1)[1], data)
