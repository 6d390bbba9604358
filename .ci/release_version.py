#!/usr/bin/env python3
"""Check that a release tag names the version being released.

Usage: release_version.py vX.Y.Z

The tag must be `v` followed by pyproject's version, and k8s/kustomization.yaml
must install that version of the image. Prints the version; exits 1 with the
reason otherwise.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
TAG = re.compile(r"v(\d+\.\d+\.\d+(?:-[0-9A-Za-z.-]+)?)")


def check(tag: str, root: Path = ROOT) -> str:
    match = TAG.fullmatch(tag)
    if match is None:
        raise ValueError(f"tag {tag!r} is not a release tag: expected vX.Y.Z or vX.Y.Z-suffix")
    version = match.group(1)
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    if project != version:
        raise ValueError(
            f"tag {tag!r} names version {version} but pyproject.toml says {project}: "
            "change pyproject's version (and the CHANGELOG) and tag again"
        )
    kustomization = yaml.safe_load((root / "k8s" / "kustomization.yaml").read_text())
    tags = [
        str(image.get("newTag"))
        for image in kustomization.get("images") or []
        if image.get("name") == "gpuslice"
    ]
    if tags != [version]:
        raise ValueError(
            f"k8s/kustomization.yaml installs the gpuslice image at {tags or 'no tag'}, "
            f"not {version}: set its newTag to {version!r}"
        )
    return version


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: release_version.py vX.Y.Z", file=sys.stderr)
        return 2
    try:
        print(check(argv[1]))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
