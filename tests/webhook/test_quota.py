"""The parts of admission that are plain functions: quota arithmetic and JSON Patch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonpatch
import pytest

from gpuslice_common.config import RequestSettings
from gpuslice_common.devicetypes import with_vendors
from gpuslice_common.models import ContainerGpuRequest, MemoryRequest
from gpuslice_webhook.mutation import Denied
from gpuslice_webhook.patch import Patch, escape, pointer
from gpuslice_webhook.quota import Demand, QuotaLimit, check, gpu_limits, request_demand

SETTINGS = RequestSettings()
VENDORS = with_vendors(
    SETTINGS, str(Path(__file__).parents[1] / "data" / "hami-device-config.yaml")
)


def request(
    name: str,
    mib: int | None = 1000,
    cores: int = 10,
    count: int = 1,
    *,
    init: bool = False,
    sidecar: bool = False,
) -> ContainerGpuRequest:
    memory = MemoryRequest(mib=mib) if mib is not None else MemoryRequest(percent=50)
    return ContainerGpuRequest(
        name=name, init=init, sidecar=sidecar, count=count, memory=memory, cores=cores
    )


# ---------------------------------------------------------------- a pod's peak


def test_apps_run_together_and_count_per_card() -> None:
    demand = request_demand([request("a", 1000, 10, count=2), request("b", 500, 30)])
    assert (demand.memory_mib, demand.cores) == (2500, 50)


def test_init_containers_run_one_at_a_time() -> None:
    demand = request_demand(
        [request("i1", 8000, 90, init=True), request("i2", 100, 5, init=True), request("a")]
    )
    assert (demand.memory_mib, demand.cores) == (8000, 90)


def test_sidecars_run_beside_later_init_containers_and_the_apps() -> None:
    demand = request_demand(
        [
            request("early", 3000, 10, init=True),  # runs alone: 3000
            request("side", 1000, 20, init=True, sidecar=True),
            request("late", 2500, 10, init=True),  # beside the sidecar: 3500
            request("app", 1500, 40),  # beside the sidecar: 2500, 60 cores
        ]
    )
    assert (demand.memory_mib, demand.cores) == (3500, 60)


def test_shares_of_a_card_are_unpriced() -> None:
    demand = request_demand([request("a", mib=None), request("b", 1000)])
    assert demand.memory_mib == 1000
    assert [c.name for c in demand.unpriced] == ["a"]


# ---------------------------------------------------------------- quotas


def quota(name: str, hard: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"hard": hard}}


def test_gpu_limits_are_the_limits_keys() -> None:
    quotas = [
        quota("a", {"limits.nvidia.com/gpumem": "4000", "limits.cpu": "8", "pods": "10"}),
        quota("b", {"limits.nvidia.com/gpucores": 300, "limits.nvidia.com/gpu": "4"}),
        # Kubernetes counts requests.<extended resource> itself, per container
        quota("k8s", {"requests.nvidia.com/gpumem": "100"}),
        quota("c", {"limits.nvidia.com/gpumem": "lots"}),  # unreadable: ignored
        {"metadata": {"name": "d"}},  # no spec
    ]
    assert gpu_limits(quotas, SETTINGS) == [
        QuotaLimit("a", "limits.nvidia.com/gpumem", "memory", 4000),
        QuotaLimit("b", "limits.nvidia.com/gpucores", "cores", 300),
    ]


def test_gpu_limits_follow_configured_resource_names() -> None:
    settings = RequestSettings.model_validate({"resources": {"memory": "example.com/vram"}})
    quotas = [quota("a", {"limits.example.com/vram": "10", "limits.nvidia.com/gpumem": "5"})]
    assert [limit.key for limit in gpu_limits(quotas, settings)] == ["limits.example.com/vram"]


def test_gpu_limits_read_every_vendors_keys_in_their_units() -> None:
    quotas = [
        quota(
            "v",
            {
                "limits.cambricon.com/mlu.smlu.vmemory": "40",
                "limits.mthreads.com/sgpu-core": "32",
                "limits.cambricon.com/vmlu": "4",  # a count: not a GPU quota key
            },
        )
    ]
    assert gpu_limits(quotas, VENDORS) == [
        QuotaLimit("v", "limits.cambricon.com/mlu.smlu.vmemory", "memory", 40, "cambricon", 256),
        QuotaLimit("v", "limits.mthreads.com/sgpu-core", "cores", 32, "mthreads"),
    ]


def test_a_vendor_memory_limit_compares_mib_and_reports_units_rounded_up() -> None:
    limit = QuotaLimit("q", "limits.cambricon.com/mlu.smlu.vmemory", "memory", 4, "cambricon", 256)
    used = Demand(257, vendor="cambricon")  # 1.004 units: shown as 2
    check([limit], Demand(767, vendor="cambricon"), used, "ns")  # 1024 MiB: fits
    with pytest.raises(Denied) as refused:
        check([limit], Demand(768, vendor="cambricon"), used, "ns")
    assert refused.value.message == (
        "exceeded quota: q, requested: limits.cambricon.com/mlu.smlu.vmemory=3, used: "
        "limits.cambricon.com/mlu.smlu.vmemory=2, limited: limits.cambricon.com/mlu.smlu.vmemory=4"
    )
    # another vendor's pod is not held to it, nor an NVIDIA pod
    check([limit], Demand(10**6, vendor="hygon"), used, "ns")
    check([limit], Demand(10**6), used, "ns")


def test_check_allows_exactly_the_limit_and_refuses_one_more() -> None:
    limits = [QuotaLimit("q", "limits.nvidia.com/gpucores", "cores", 100)]
    check(limits, Demand(0, 40), Demand(0, 60), "ns")
    with pytest.raises(Denied, match=r"requested: limits.nvidia.com/gpucores=41, used: "):
        check(limits, Demand(0, 41), Demand(0, 60), "ns")


def test_a_pod_already_over_is_refused_only_for_what_it_asks() -> None:
    limits = [QuotaLimit("q", "limits.nvidia.com/gpumem", "memory", 100)]
    check(limits, Demand(0, 50), Demand(500, 0), "ns")  # asks no memory
    with pytest.raises(Denied):
        check(limits, Demand(1, 0), Demand(500, 0), "ns")


# ---------------------------------------------------------------- JSON Patch


@pytest.mark.parametrize(
    ("token", "escaped"),
    [
        ("nvidia.com/gpu", "nvidia.com~1gpu"),
        ("a~b", "a~0b"),
        ("~/", "~0~1"),
        ("~1", "~01"),
        (3, "3"),
    ],
)
def test_pointer_escapes(token: str | int, escaped: str) -> None:
    assert escape(token) == escaped


def test_patch_operations_apply_with_an_independent_implementation() -> None:
    doc: dict[str, Any] = {"m": {"a/b": 1}, "l": [1], "none": None}
    patch = Patch()
    patch.put(["m"], doc["m"], "a/b", 2)  # present: replace
    patch.put(["m"], doc["m"], "c~d", 3)  # absent: add
    patch.put(["new"], None, "x/y", 4)  # no map: the map is added whole
    patch.put(["none"], doc["none"], "k", 5)  # null map: replaced whole
    patch.append(["l"], doc["l"], [2, 3])
    patch.append(["fresh"], None, [{"name": "v"}])
    patch.append(["l"], doc["l"], [])  # nothing to add: no operation
    assert pointer("spec", "containers", 0, "env", "-") == "/spec/containers/0/env/-"
    result = jsonpatch.apply_patch(doc, patch.operations)
    assert result == {
        "m": {"a/b": 2, "c~d": 3},
        "l": [1, 2, 3],
        "none": {"k": 5},
        "new": {"x/y": 4},
        "fresh": [{"name": "v"}],
    }
    assert len(patch.operations) == 7
