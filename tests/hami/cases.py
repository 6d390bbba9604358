"""HAMi's own scheduler and webhook test tables, as data: loading and building.

Each YAML file under ``cases/`` holds the cases taken from one HAMi test file,
in gpuslice's own form. A case names its source (``hami``: ``file: Test/case``),
its ``kind`` (``place``, ``parse``, ``mutate`` or ``footprint``; ``file`` names the HAMi
file where it is not the document's ``hami_file``), what goes in and HAMi's
outcome (``expect``). Where gpuslice answers otherwise on purpose, the case
says why (``differs``) and gives gpuslice's outcome (``gpuslice``), which is
then what the test asserts.

Cards (``nodes: {name: [card, ...]}``): ``uuid``, ``model`` (default
``NVIDIA``, HAMi's device type), ``memory`` (MiB), ``cores`` (total, default
100), ``slots`` (split count, default 10), ``used`` (slots), ``used_mem``,
``used_cores``, ``numa``, ``healthy``, ``cordoned``, ``owner`` (held alone),
``mode`` and ``mig_profiles`` (``name``, ``memory``, ``cores``, ``slices``,
``placements``: ``[start, size]`` pairs), ``mig_instances``.

Pods: ``containers`` and ``init`` (each ``name``, ``limits``, ``requests``,
``restartPolicy``; resource keys without the ``nvidia.com/`` prefix) and
``annotations``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice_common.config import RequestDefaults, RequestSettings, ResourceNames
from gpuslice_common.models import (
    GpuCapacity,
    GpuDevice,
    GpuState,
    GpuUsage,
    MigInstance,
    MigPlacement,
    MigProfile,
    VgpuMode,
)

CASES = Path(__file__).parent / "cases"
KINDS = ("place", "parse", "mutate", "footprint")
RESOURCE_PREFIX = "nvidia.com/"


@dataclass(frozen=True)
class Case:
    """One HAMi test case in gpuslice's form."""

    source: str  # "<HAMi file>: <Test>/<case>"
    kind: str
    data: Mapping[str, Any]

    @property
    def differs(self) -> str | None:
        reason = self.data.get("differs")
        return str(reason) if reason is not None else None

    @property
    def outcome(self) -> Mapping[str, Any]:
        """What the test asserts: gpuslice's outcome where it differs, else HAMi's."""
        key = "gpuslice" if self.differs else "expect"
        outcome = self.data[key]
        assert isinstance(outcome, Mapping), f"{self.source}: {key} must be a mapping"
        return outcome


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (which
    would otherwise keep the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
        twice = sorted({str(k) for k in keys if keys.count(k) > 1})
        if twice:
            raise yaml.constructor.ConstructorError(
                None, None, f"key given twice: {', '.join(twice)}", node.start_mark
            )
        return super().construct_mapping(node, deep=deep)


def load(path: Path) -> list[Case]:
    document = yaml.load(path.read_text(), Loader=_StrictLoader)  # SafeLoader underneath
    hami_file = document["hami_file"]
    cases = []
    for entry in document["cases"]:
        kind = entry["kind"]
        assert kind in KINDS, f"{path.name}: {entry.get('hami')}: unknown kind {kind!r}"
        assert "expect" in entry, f"{path.name}: {entry['hami']}: HAMi's outcome is missing"
        if "differs" in entry:
            assert "gpuslice" in entry, f"{entry['hami']}: differs without gpuslice's outcome"
        source = entry.get("file", hami_file)  # a case may come from a neighbouring file
        cases.append(Case(f"{source}: {entry['hami']}", kind, entry))
    return cases


def all_cases() -> list[Case]:
    return [case for path in sorted(CASES.glob("*.yaml")) for case in load(path)]


def params(kind: str) -> list[Any]:
    """The cases of one kind as pytest parameters, each named for its HAMi source."""
    return [pytest.param(case, id=_test_id(case)) for case in all_cases() if case.kind == kind]


def _test_id(case: Case) -> str:
    """``Test/case`` with blanks as underscores, in ASCII."""
    name = case.source.split(": ", 1)[1]
    return name.replace(" ", "_").replace("\u2014", "-")


# ---------------------------------------------------------------- pods


def _resources(amounts: Mapping[str, Any] | None) -> dict[str, Any]:
    return {
        (key if "/" in key else RESOURCE_PREFIX + key): value
        for key, value in (amounts or {}).items()
    }


def _container(spec: Mapping[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = {"name": spec["name"], "image": "registry.example/app:1"}
    resources: dict[str, Any] = {}
    for part in ("limits", "requests"):
        if part in spec:
            resources[part] = _resources(spec[part])
    if resources:
        container["resources"] = resources
    for key in ("restartPolicy", "env", "securityContext"):
        if key in spec:
            container[key] = copy.deepcopy(spec[key])
    return container


def pod_manifest(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A Kubernetes Pod from a case's ``pod``."""
    metadata: dict[str, Any] = {
        "name": spec.get("name", "hami-case"),
        "namespace": "default",
        "uid": "uid-hami-case",
        "annotations": dict(spec.get("annotations") or {}),
    }
    if spec.get("labels"):
        metadata["labels"] = dict(spec["labels"])
    body: dict[str, Any] = {"containers": [_container(c) for c in spec.get("containers", ())]}
    if spec.get("init"):
        body["initContainers"] = [_container(c) for c in spec["init"]]
    for key in ("nodeName", "schedulerName"):
        if key in spec:
            body[key] = spec[key]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": body}


# ---------------------------------------------------------------- cards


def _profile(spec: Mapping[str, Any]) -> MigProfile:
    return MigProfile(
        name=spec["name"],
        memory_mib=spec["memory"],
        cores=spec["cores"],
        slices=spec["slices"],
        placements=tuple(MigPlacement(start=s, size=n) for s, n in spec["placements"]),
    )


def _instance(spec: Mapping[str, Any]) -> MigInstance:
    start, size = spec["placement"]
    return MigInstance(
        uuid=spec["uuid"],
        profile=spec["profile"],
        placement=MigPlacement(start=start, size=size),
    )


def card(node: str, index: int, spec: Mapping[str, Any]) -> GpuState:
    """One card of a case as the ledger would hold it."""
    device = GpuDevice(
        uuid=spec["uuid"],
        index=index,
        model=spec.get("model", "NVIDIA"),
        memory_mib=spec["memory"],
        numa=spec.get("numa"),
        healthy=spec.get("healthy", True),
        mig=spec.get("mode") == "mig",
        mode=VgpuMode(spec.get("mode", "hami-core")),
        mig_profiles=tuple(_profile(p) for p in spec.get("mig_profiles", ())),
        mig_instances=tuple(_instance(i) for i in spec.get("mig_instances", ())),
    )
    return GpuState(
        node=node,
        device=device,
        capacity=GpuCapacity(
            memory_mib=spec["memory"], cores=spec.get("cores", 100), slots=spec.get("slots", 10)
        ),
        used=GpuUsage(
            memory_mib=spec.get("used_mem", 0),
            cores=spec.get("used_cores", 0),
            slots=spec.get("used", 0),
            exclusive_owner=spec.get("owner"),
        ),
        cordoned=spec.get("cordoned", False),
    )


def nodes(spec: Mapping[str, list[Mapping[str, Any]]]) -> list[tuple[str, list[GpuState]]]:
    """Each node of a case with its cards, in the case's order."""
    return [
        (name, [card(name, i, c) for i, c in enumerate(cards or ())])
        for name, cards in spec.items()
    ]


def request_settings(spec: Mapping[str, Any] | None) -> RequestSettings:
    """Request settings from a case's ``settings`` (``defaults``, ``resources``)."""
    spec = spec or {}
    return RequestSettings(
        resources=ResourceNames(**spec.get("resources", {})),
        defaults=RequestDefaults(**spec.get("defaults", {})),
    )
