"""What ``kubectl kustomize`` does with a kustomization.yaml, for the features
gpuslice's use (resources, bases by directory, components, labels, images,
ConfigMap generators without a name hash, and patches: JSON 6902 ones, and
strategic-merge ones that delete an object), so
the manifests can be checked on machines without kubectl; where kubectl exists
the tests compare the two."""

from __future__ import annotations

import copy
import os
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
    "CronJob": ("spec", "jobTemplate", "spec", "template", "spec"),
}


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects ``directory``'s kustomization makes: its resources (files, or
    directories with a kustomization of their own) in order, then its
    components, its ConfigMap generators, then its patches, labels and images."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    if kustomization.get("kind", "Kustomization") != "Kustomization":
        raise ValueError(f"{directory} is a {kustomization['kind']}: include it as a component")
    return _build(directory, kustomization, [])


def _build(
    directory: Path, kustomization: dict[str, Any], out: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    allowed = {
        "apiVersion",
        "kind",
        "labels",
        "resources",
        "images",
        "patches",
        "components",
        "configMapGenerator",
    }
    unknown = set(kustomization) - allowed
    if unknown:
        raise ValueError(f"kustomization features not rendered here: {sorted(unknown)}")
    for name in kustomization.get("resources") or []:
        path = directory / name
        if path.is_dir():
            out.extend(render(path))
            continue
        out.extend(copy.deepcopy(doc) for doc in yaml.safe_load_all(path.read_text()) if doc)
    for name in kustomization.get("components") or []:
        component = yaml.safe_load((directory / name / "kustomization.yaml").read_text())
        if component.get("kind") != "Component":
            raise ValueError(f"{directory / name} is not a Component")
        out = _build(directory / name, component, out)
    for generator in kustomization.get("configMapGenerator") or []:
        out = _generate(out, generator, directory)
    for patch in kustomization.get("patches") or []:
        out = _patch(out, patch, directory)
    for doc in out:  # kustomize drops what a patch left empty
        if doc.get("metadata", {}).get("annotations") == {}:
            del doc["metadata"]["annotations"]
    labels: dict[str, str] = {}
    for group in kustomization.get("labels") or []:
        labels.update(group.get("pairs") or {})
    images = {i["name"]: i for i in kustomization.get("images") or []}
    for doc in out:
        meta = doc.setdefault("metadata", {})
        if labels:
            meta["labels"] = {**(meta.get("labels") or {}), **labels}
        path = POD_SPEC_PATHS.get(doc["kind"])
        if path is not None and images:
            spec: Any = doc
            for key in path:
                spec = spec[key]
            for container in spec.get("containers", []) + spec.get("initContainers", []):
                _retag(container, images)
    return out


def _generate(
    objects: list[dict[str, Any]], generator: dict[str, Any], directory: Path
) -> list[dict[str, Any]]:
    """A configMapGenerator: a new ConfigMap (``behavior: create``, with its name
    hash turned off), or one already built merged into or replaced."""
    unknown = set(generator) - {"name", "namespace", "behavior", "literals", "files", "options"}
    if unknown:
        raise ValueError(f"configMapGenerator features not rendered here: {sorted(unknown)}")
    data: dict[str, str] = {}
    for literal in generator.get("literals") or []:
        key, sep, value = literal.partition("=")
        if not sep:
            raise ValueError(f"a literal without '=': {literal!r}")
        data[key] = value
    for entry in generator.get("files") or []:
        key, sep, path = entry.partition("=")
        if not sep:
            key, path = Path(entry).name, entry
        data[key] = (directory / path).read_text()
    name, namespace = generator["name"], generator.get("namespace")
    behavior = generator.get("behavior", "create")
    if behavior == "create":
        if not (generator.get("options") or {}).get("disableNameSuffixHash"):
            raise ValueError(f"ConfigMap {name}: a name hash suffix is not rendered here")
        meta: dict[str, Any] = {"name": name}
        if namespace is not None:
            meta["namespace"] = namespace
        return [*objects, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}]
    target = {"kind": "ConfigMap", "name": name, "namespace": namespace}
    (existing,) = [o for o in objects if _matches(o, target)] or [None]
    if existing is None:
        raise ValueError(f"configMapGenerator {behavior}: no ConfigMap {name} to {behavior}")
    if behavior == "merge":
        existing["data"] = {**(existing.get("data") or {}), **data}
    elif behavior == "replace":
        existing["data"] = data
    else:
        raise ValueError(f"configMapGenerator behavior not rendered here: {behavior}")
    return objects


def _retag(container: dict[str, Any], images: dict[str, dict[str, str]]) -> None:
    image = container["image"]
    name, _, tag = image.partition(":")
    rule = images.get(name)
    if rule is None:
        return
    container["image"] = f"{rule.get('newName', name)}:{rule.get('newTag', tag or 'latest')}"


def _patch(
    objects: list[dict[str, Any]], entry: dict[str, Any], directory: Path
) -> list[dict[str, Any]]:
    unknown = set(entry) - {"path", "patch", "target"}
    if unknown:
        raise ValueError(f"patch features not rendered here: {sorted(unknown)}")
    text = entry["patch"] if "patch" in entry else (directory / entry["path"]).read_text()
    body = yaml.safe_load(text)
    if isinstance(body, list):  # JSON 6902: applied to the target
        target = entry["target"]
        if set(target) - {"kind", "name", "namespace"}:
            raise ValueError(f"patch targets not rendered here: {target}")
        matched = [o for o in objects if _matches(o, target)]
        if not matched:
            raise ValueError(f"no object matches the patch target {target}")
        for obj in matched:
            for operation in body:
                _json6902(obj, operation)
        return objects
    # strategic merge: only deleting an object is rendered here
    if body.get("$patch") != "delete" or "target" in entry:
        raise ValueError("strategic-merge patches other than $patch: delete are not rendered here")
    target = {
        "kind": body["kind"],
        "name": body["metadata"]["name"],
        "namespace": body["metadata"].get("namespace"),
    }
    kept = [o for o in objects if not _matches(o, target)]
    if len(kept) != len(objects) - 1:
        raise ValueError(f"the patch deletes no one object: {target}")
    return kept


def _matches(obj: dict[str, Any], target: dict[str, Any]) -> bool:
    meta = obj["metadata"]
    return (
        obj["kind"] == target["kind"]
        and meta["name"] == target["name"]
        and (target.get("namespace") is None or meta.get("namespace") == target["namespace"])
    )


def _json6902(obj: dict[str, Any], operation: dict[str, Any]) -> None:
    """One RFC 6902 operation (add, remove, replace, test) on ``obj``, in place."""
    op, path = operation["op"], operation["path"]
    keys = [k.replace("~1", "/").replace("~0", "~") for k in path.split("/")[1:]]
    parent: Any = obj
    try:
        for key in keys[:-1]:
            parent = parent[int(key)] if isinstance(parent, list) else parent[key]
    except (KeyError, IndexError):
        raise ValueError(f"no {path} to {op}") from None
    last = keys[-1]
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if index > len(parent) or (op != "add" and index == len(parent)):
            raise ValueError(f"no {path} to {op}")
        if op == "add":
            parent.insert(index, copy.deepcopy(operation["value"]))
        elif op == "remove":
            del parent[index]
        elif op == "replace":
            parent[index] = copy.deepcopy(operation["value"])
        elif op == "test":
            if parent[index] != operation["value"]:
                raise ValueError(f"test failed at {path}: {parent[index]!r}")
        else:
            raise ValueError(f"JSON patch operation not rendered here: {op}")
        return
    if op in ("remove", "replace", "test") and last not in parent:
        raise ValueError(f"no {path} to {op}")
    if op in ("add", "replace"):
        parent[last] = copy.deepcopy(operation["value"])
    elif op == "remove":
        del parent[last]
    elif op == "test":
        if parent[last] != operation["value"]:
            raise ValueError(f"test failed at {path}: {parent[last]!r}")
    else:
        raise ValueError(f"JSON patch operation not rendered here: {op}")


def overlay(directory: Path, base: Path, *components: str) -> Path:
    """An overlay of one's own in ``directory``, beside ``base``: the base with
    some of its components (directories under it), as docs/install.md shows."""
    directory.mkdir(parents=True, exist_ok=True)
    relative = Path(os.path.relpath(base, directory))
    (directory / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [str(relative)],
                "components": [str(relative / c) for c in components],
            },
            sort_keys=False,
        )
    )
    return directory
