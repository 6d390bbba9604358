#!/usr/bin/env python3
"""Check that a release tag names the version being released.

Usage: release_version.py vX.Y.Z

The tag must be `v` followed by pyproject's version, and k8s/ must install that
version of the image (its `images:` entry named gpuslice, in k8s/kustomization.yaml
or a directory it includes). Prints the version; exits 1 with the reason
otherwise.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
TAG = re.compile(r"v(\d+\.\d+\.\d+(?:-[0-9A-Za-z.-]+)?)")


def k8s_images(root: Path = ROOT) -> list[tuple[str, str]]:
    """Every (newName, newTag) k8s/ gives the image `gpuslice`, from its
    kustomization and the directories under k8s/ it includes."""
    k8s = (root / "k8s").resolve()
    found: list[tuple[str, str]] = []
    seen: set[Path] = set()
    todo = [k8s]
    while todo:
        directory = todo.pop()
        if directory in seen or not (directory / "kustomization.yaml").is_file():
            continue
        seen.add(directory)
        doc = yaml.safe_load((directory / "kustomization.yaml").read_text()) or {}
        for image in doc.get("images") or []:
            if image.get("name") == "gpuslice":
                found.append((str(image.get("newName")), str(image.get("newTag"))))
        for entry in [*(doc.get("resources") or []), *(doc.get("components") or [])]:
            included = (directory / str(entry)).resolve()
            if included.is_relative_to(k8s) and included.is_dir():
                todo.append(included)
    return found


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
    tags = [tag for _, tag in k8s_images(root)]
    if tags != [version]:
        raise ValueError(
            f"k8s/ installs the gpuslice image at {tags or 'no tag'}, not {version}: "
            f"set the newTag of its images: entry named gpuslice to {version!r}"
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
