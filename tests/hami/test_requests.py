"""HAMi's cases about how a pod's GPU request is read, against ``parse_pod``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from gpuslice_common.models import ContainerGpuRequest, PodGpuRequest
from gpuslice_common.requests import RequestError, parse_pod
from tests.hami.cases import Case, params, pod_manifest, request_settings


def container_view(c: ContainerGpuRequest) -> dict[str, Any]:
    """A parsed container in the cases' terms."""
    view: dict[str, Any] = {"name": c.name, "count": c.count, "cores": c.cores}
    if c.memory.mib is not None:
        view["mib"] = c.memory.mib
    else:
        view["percent"] = c.memory.percent
    view["init"] = c.init
    view["priority"] = c.priority
    return view


def request_view(request: PodGpuRequest | None) -> dict[str, Any]:
    if request is None:
        return {"none": True}
    selector = request.selector
    return {
        "containers": [container_view(c) for c in request.containers],
        "numa_bind": selector.numa_bind,
        "include_types": list(selector.include_types),
        "exclude_types": list(selector.exclude_types),
        "include_uuids": list(selector.include_uuids),
        "exclude_uuids": list(selector.exclude_uuids),
        "vgpu_mode": request.vgpu_mode.value if request.vgpu_mode else None,
        "gpu_policy": request.gpu_policy.value if request.gpu_policy else None,
        "node_policy": request.node_policy.value if request.node_policy else None,
    }


def assert_outcome(source: str, got: Mapping[str, Any], wanted: Mapping[str, Any]) -> None:
    """Every field the case names must match; containers field by field."""
    for key, value in wanted.items():
        if key == "containers":
            have = got.get("containers")
            assert have is not None, f"{source}: no GPU request"
            assert len(have) == len(value), f"{source}: {have}"
            for mine, theirs in zip(have, value, strict=True):
                assert {k: mine[k] for k in theirs} == theirs, f"{source}: {mine}"
        else:
            assert got.get(key) == value, f"{source}: {key} is {got.get(key)!r}, not {value!r}"


@pytest.mark.parametrize("case", params("parse"))
def test_hami_request_case(case: Case) -> None:
    outcome = case.outcome
    settings = request_settings(case.data.get("settings"))
    manifest = pod_manifest(case.data["pod"])
    if "error" in outcome:
        with pytest.raises(RequestError) as caught:
            parse_pod(manifest, settings)
        assert outcome["error"] in str(caught.value), case.source
        return
    assert_outcome(case.source, request_view(parse_pod(manifest, settings)), outcome)
