"""A hostile checkpoint file: unpickling it runs code (it creates a marker file)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from dcp.checkpoint.directory import FORMAT_VERSION, MANIFEST_DIGEST, SHARED, manifest_digest


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def plant_payload(checkpoint: Path, file_name: str, marker: Path) -> None:
    """Replace ``checkpoint/file_name`` with a pickle payload that would create ``marker``, and
    recompute the manifest's sizes and checksums as an attacker would."""
    torch.save({"state": _Payload(marker)}, checkpoint / file_name)
    rewrite_manifest(checkpoint)


def rewrite_manifest(checkpoint: Path) -> None:
    """Sizes and digests of every file the manifest lists, and the manifest's own, recomputed
    from the files."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    current = manifest["format_version"] == FORMAT_VERSION
    for name in manifest["files"]:
        data = (checkpoint / name).read_bytes()
        manifest["files"][name] = len(data)
        digest = hashlib.sha256(data).hexdigest()
        if not current:
            manifest.setdefault("sha256", {})[name] = digest
        elif name == SHARED:
            manifest["shared_sha256"] = digest
    if current:
        manifest[MANIFEST_DIGEST] = manifest_digest(manifest)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
