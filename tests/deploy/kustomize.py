"""What ``kubectl kustomize`` does with k8s/kustomization.yaml, for the features it
uses (resources, labels, images), so the manifests can be checked on machines
without kubectl; where kubectl exists the tests compare the two."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

# kinds whose pod template gets the labels too (kustomize's labels with
# includeTemplates defaults to false, so only metadata.labels here)
POD_SPEC_PATHS = {
    "Deployment": ("spec", "template", "spec"),
    "DaemonSet": ("spec", "template", "spec"),
    "StatefulSet": ("spec", "template", "spec"),
    "Job": ("spec", "template", "spec"),
}


def render(directory: Path) -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    allowed = {"apiVersion", "kind", "labels", "resources", "images"}
    unknown = set(kustomization) - allowed
    if unknown:
        raise ValueError(f"kustomization features not rendered here: {sorted(unknown)}")
    labels: dict[str, str] = {}
    for group in kustomization.get("labels") or []:
        labels.update(group.get("pairs") or {})
    images = {i["name"]: i for i in kustomization.get("images") or []}
    out: list[dict[str, Any]] = []
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((directory / name).read_text()):
            if not doc:
                continue
            doc = copy.deepcopy(doc)
            meta = doc.setdefault("metadata", {})
            meta["labels"] = {**(meta.get("labels") or {}), **labels}
            path = POD_SPEC_PATHS.get(doc["kind"])
            if path is not None:
                spec: Any = doc
                for key in path:
                    spec = spec[key]
                for container in spec.get("containers", []) + spec.get("initContainers", []):
                    _retag(container, images)
            out.append(doc)
    return out


def _retag(container: dict[str, Any], images: dict[str, dict[str, str]]) -> None:
    image = container["image"]
    name, _, tag = image.partition(":")
    rule = images.get(name)
    if rule is None:
        return
    container["image"] = f"{rule.get('newName', name)}:{rule.get('newTag', tag or 'latest')}"
