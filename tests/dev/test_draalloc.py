"""The local stack's DRA allocator: first fit in slice order, sharing by consumable
capacity, exclusive devices, selectors (and the CEL it refuses), firstAvailable;
every allocation it answers is a valid resource.k8s.io/v1 ResourceClaim status
for Kubernetes 1.34."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from gpuslice_cli.dev.draalloc import AllocationError, allocate
from gpuslice_cli.dev.dracel import SelectorError, UnsupportedSelector, compile_selector
from gpuslice_common.dra import API_VERSION, CORES, DEVICE_CLASS, DRIVER, MEMORY

KUBERNETES_VERSION = "1.34.0"
GI = 1024**3
NODE = "node-a"
CLASSES = {
    DEVICE_CLASS: {
        "apiVersion": API_VERSION,
        "kind": "DeviceClass",
        "metadata": {"name": DEVICE_CLASS},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
    }
}


def card(
    name: str, model: str = "A100", memory: int = 40 * GI, *, shared: bool = True
) -> dict[str, Any]:
    device: dict[str, Any] = {
        "name": name,
        "attributes": {"model": {"string": model}, "uuid": {"string": f"GPU-{name}"}},
        "capacity": {
            MEMORY: {"value": str(memory)},
            CORES: {"value": "100"},
        },
    }
    if shared:
        device["allowMultipleAllocations"] = True
        device["capacity"][MEMORY]["requestPolicy"] = {
            "default": str(memory),
            "validRange": {"min": "1Mi", "step": "1Mi"},
        }
        device["capacity"][CORES]["requestPolicy"] = {
            "default": "100",
            "validRange": {"min": "1", "step": "1"},
        }
    return device


def node_slice(*devices: dict[str, Any], node: str = NODE, generation: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{DRIVER}"},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": list(devices),
        },
    }


def exactly(
    name: str = "main",
    count: int = 1,
    memory: str | None = None,
    cores: str | None = None,
    selectors: list[str] = (),  # type: ignore[assignment]
) -> dict[str, Any]:
    request: dict[str, Any] = {"deviceClassName": DEVICE_CLASS, "count": count}
    requests = {k: v for k, v in ((MEMORY, memory), (CORES, cores)) if v is not None}
    if requests:
        request["capacity"] = {"requests": requests}
    if selectors:
        request["selectors"] = [{"cel": {"expression": e}} for e in selectors]
    return {"name": name, "exactly": request}


def claim(*requests: dict[str, Any], **devices: Any) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "default", "uid": "u-1"},
        "spec": {"devices": {"requests": list(requests), **devices}},
    }


def allocated(obj: dict[str, Any], *others: dict[str, Any], **kw: Any) -> dict[str, Any] | None:
    """``allocate`` on NODE; a non-None answer is checked as a v1.34 ResourceClaim status."""
    answer = allocate(obj, kw.get("node", NODE), kw["slices"], list(others), CLASSES)
    if answer is not None:
        full = {**obj, "status": {"allocation": answer}}
        kubernetes_validate.validate(full, KUBERNETES_VERSION, strict=True)
    return answer


def devices_of(answer: dict[str, Any] | None) -> list[tuple[str, str]]:
    assert answer is not None
    return [(r["request"], r["device"]) for r in answer["devices"]["results"]]


def test_a_claim_gets_the_first_fitting_device_and_a_node_selector() -> None:
    slices = [node_slice(card("gpu-0"), card("gpu-1"))]
    answer = allocated(claim(exactly(memory="10Gi", cores="30")), slices=slices)
    assert devices_of(answer) == [("main", "gpu-0")]
    assert answer is not None
    (result,) = answer["devices"]["results"]
    assert result["driver"] == DRIVER
    assert result["pool"] == NODE
    assert result["consumedCapacity"] == {MEMORY: str(10 * GI), CORES: "30"}
    assert result["shareID"]
    assert answer["nodeSelector"] == {
        "nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}
        ]
    }


def test_a_claim_that_fits_nowhere_gets_none() -> None:
    slices = [node_slice(card("gpu-0", memory=16 * GI))]
    assert allocated(claim(exactly(memory="20Gi")), slices=slices) is None
    assert allocated(claim(exactly(count=2)), slices=slices) is None
    # another node's slice is not this node's
    other = [node_slice(card("gpu-9"), node="node-b")]
    assert allocated(claim(exactly()), slices=other) is None


def test_a_shared_device_takes_claims_until_its_capacity_is_used() -> None:
    slices = [node_slice(card("gpu-0", memory=40 * GI), card("gpu-1", memory=40 * GI))]
    held: list[dict[str, Any]] = []
    placed = []
    for _ in range(4):
        answer = allocated(claim(exactly(memory="15Gi", cores="20")), *held, slices=slices)
        assert answer is not None
        held.append(answer)
        placed.append(devices_of(answer)[0][1])
    # 15 Gi twice fits in 40 Gi, a third does not: first fit then moves on
    assert placed == ["gpu-0", "gpu-0", "gpu-1", "gpu-1"]
    assert allocated(claim(exactly(memory="15Gi")), *held, slices=slices) is None
    # what is left on gpu-0 (10 Gi) still takes a small claim
    small = allocated(claim(exactly(memory="10Gi", cores="60")), *held, slices=slices)
    assert devices_of(small) == [("main", "gpu-0")]
    assert small is not None
    # and then cores run out on gpu-0 before memory does on gpu-1
    assert devices_of(
        allocated(claim(exactly(memory="1Gi", cores="50")), *held, small, slices=slices)
    ) == [("main", "gpu-1")]


def test_requests_are_rounded_up_by_the_request_policy_and_default_to_it() -> None:
    slices = [node_slice(card("gpu-0", memory=40 * GI))]
    answer = allocated(claim(exactly(memory="1500Ki")), slices=slices)
    assert answer is not None
    consumed = answer["devices"]["results"][0]["consumedCapacity"]
    assert consumed == {MEMORY: str(2 * 1024**2), CORES: "100"}  # 2 Mi; cores default 100
    # a whole-card claim (no capacity requests) leaves nothing for the next one
    whole = allocated(claim(exactly()), slices=slices)
    assert whole is not None
    assert allocated(claim(exactly(memory="1Mi", cores="1")), whole, slices=slices) is None


def test_an_exclusive_device_is_held_by_one_claim() -> None:
    slices = [node_slice(card("gpu-0", shared=False), card("gpu-1", shared=False))]
    first = allocated(claim(exactly()), slices=slices)
    assert devices_of(first) == [("main", "gpu-0")]
    assert first is not None
    assert "shareID" not in first["devices"]["results"][0]
    assert "consumedCapacity" not in first["devices"]["results"][0]
    second = allocated(claim(exactly()), first, slices=slices)
    assert devices_of(second) == [("main", "gpu-1")]
    assert second is not None
    assert allocated(claim(exactly()), first, second, slices=slices) is None
    # a capacity request larger than the device refuses it
    assert allocated(claim(exactly(memory="41Gi")), slices=slices) is None


def test_count_takes_distinct_exclusive_devices_in_order() -> None:
    slices = [node_slice(*(card(f"gpu-{i}", shared=False) for i in range(4)))]
    first = allocated(claim(exactly(count=3)), slices=slices)
    assert devices_of(first) == [("main", "gpu-0"), ("main", "gpu-1"), ("main", "gpu-2")]
    assert first is not None
    assert allocated(claim(exactly(count=2)), first, slices=slices) is None


def test_a_shared_device_may_serve_two_devices_of_one_request_unless_kept_distinct() -> None:
    slices = [node_slice(card("gpu-0"), card("gpu-1"))]
    answer = allocated(claim(exactly(count=2, memory="10Gi", cores="10")), slices=slices)
    assert devices_of(answer) == [("main", "gpu-0"), ("main", "gpu-0")]
    distinct = claim(
        exactly(count=2, memory="10Gi", cores="10"),
        constraints=[{"distinctAttribute": f"{DRIVER}/uuid"}],
    )
    assert devices_of(allocated(distinct, slices=slices)) == [
        ("main", "gpu-0"),
        ("main", "gpu-1"),
    ]


def test_allocation_mode_all_takes_every_matching_device() -> None:
    slices = [node_slice(card("gpu-0", shared=False), card("gpu-1", "T4", shared=False))]
    request = {
        "name": "all",
        "exactly": {
            "deviceClassName": DEVICE_CLASS,
            "allocationMode": "All",
            "selectors": [
                {"cel": {"expression": f'device.attributes["{DRIVER}"].model == "A100"'}}
            ],
        },
    }
    answer = allocated(claim(request), slices=slices)
    assert devices_of(answer) == [("all", "gpu-0")]
    assert answer is not None
    # one of them in use: All cannot be met
    assert allocated(claim(request), answer, slices=slices) is None


def test_selectors_choose_the_device_and_backtracking_finds_the_answer() -> None:
    slices = [node_slice(card("gpu-0", "A100", shared=False), card("gpu-1", "T4", shared=False))]
    t4 = f'device.attributes["{DRIVER}"].model.lowerAscii().contains("t4")'
    assert devices_of(allocated(claim(exactly(selectors=[t4])), slices=slices)) == [
        ("main", "gpu-1")
    ]
    in_list = f'device.attributes["{DRIVER}"]["model"] in ["V100", "A100"]'
    assert devices_of(allocated(claim(exactly(selectors=[in_list])), slices=slices)) == [
        ("main", "gpu-0")
    ]
    # "any" takes gpu-0 first; "a100" then needs it: the search backs up
    two = claim(
        exactly("any"),
        exactly("a100", selectors=[f'device.attributes["{DRIVER}"].model == "A100"']),
    )
    assert devices_of(allocated(two, slices=slices)) == [("any", "gpu-1"), ("a100", "gpu-0")]
    model = f'device.attributes["{DRIVER}"].model'
    none = f'{model} != "A100" && {model} != "T4"'
    assert allocated(claim(exactly(selectors=[none])), slices=slices) is None


def test_first_available_subrequests_are_tried_in_order() -> None:
    slices = [node_slice(card("gpu-0", "T4", shared=False), card("gpu-1", "T4", shared=False))]
    model = f'device.attributes["{DRIVER}"].model'

    def sub(name: str, chosen: str, count: int = 1) -> dict[str, Any]:
        return {
            "name": name,
            "deviceClassName": DEVICE_CLASS,
            "count": count,
            "selectors": [{"cel": {"expression": f'{model} == "{chosen}"'}}],
        }

    request = {"name": "gpu", "firstAvailable": [sub("big", "A100"), sub("small", "T4", 2)]}
    assert devices_of(allocated(claim(request), slices=slices)) == [
        ("gpu/small", "gpu-0"),
        ("gpu/small", "gpu-1"),
    ]
    request = {"name": "gpu", "firstAvailable": [sub("two", "T4", 2), sub("one", "T4")]}
    first = allocated(claim(request), slices=slices)
    assert devices_of(first) == [("gpu/two", "gpu-0"), ("gpu/two", "gpu-1")]
    assert first is not None
    # with one card held, the first subrequest no longer fits; the second does
    held = {"devices": {"results": [first["devices"]["results"][0]]}}
    assert devices_of(allocated(claim(request), held, slices=slices)) == [("gpu/one", "gpu-1")]


def test_only_the_newest_generation_of_a_pool_is_used() -> None:
    slices = [node_slice(card("gpu-old"), generation=1), node_slice(card("gpu-new"), generation=2)]
    assert devices_of(allocated(claim(exactly()), slices=slices)) == [("main", "gpu-new")]


@pytest.mark.parametrize(
    "expression",
    [
        'device.capacity["gpu.gpuslice.io"].memory.compareTo(quantity("1Gi")) >= 0',
        'device.attributes["gpu.gpuslice.io"].model.size() > 2',
        "device.allowMultipleAllocations",
        'device.attributes["gpu.gpuslice.io"].model == "A" ? true : false',
        "cel.bind(x, 1, x == 1)",
        'device.driver + "x" == "y"',
        "",
    ],
)
def test_selectors_outside_the_subset_are_refused(expression: str) -> None:
    with pytest.raises(UnsupportedSelector):
        compile_selector(expression)
    slices = [node_slice(card("gpu-0"))]
    with pytest.raises(AllocationError, match="selector #0"):
        allocate(claim(exactly(selectors=[expression])), NODE, slices, [], CLASSES)


def test_cel_errors_follow_cel() -> None:
    device = {"name": "d", "driver": DRIVER, "attributes": {"index": {"int": 3}}}
    index = f'device.attributes["{DRIVER}"].index'
    assert compile_selector(f"{index} >= 2 && {index} < 4")(device)
    assert not compile_selector(f'{index} == 3 && device.driver == "other"')(device)
    # a missing attribute is an error, which a decided && / || absorbs
    missing = f'device.attributes["{DRIVER}"].model == "A100"'
    with pytest.raises(SelectorError):
        compile_selector(missing)(device)
    assert not compile_selector(f'device.driver == "other" && {missing}')(device)
    assert compile_selector(f"{missing} || {index} == 3")(device)
    assert not compile_selector(f'has(device.attributes["{DRIVER}"].model)')(device)
    with pytest.raises(SelectorError):  # int == string has no overload
        compile_selector(f'{index} == "3"')(device)
    # an error that decides aborts the allocation instead of skipping the device
    slices = [node_slice(card("gpu-0"))]
    bad = f'device.attributes["{DRIVER}"].nothere == "x"'
    with pytest.raises(AllocationError, match="nothere"):
        allocate(claim(exactly(selectors=[bad])), NODE, slices, [], CLASSES)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda c: c["spec"]["devices"]["requests"][0]["exactly"].update(deviceClassName="x"),
            "not found",
        ),
        (
            lambda c: c["spec"]["devices"]["requests"][0]["exactly"].update(adminAccess=True),
            "adminAccess",
        ),
        (lambda c: c["spec"]["devices"]["requests"][0]["exactly"].update(count=0), "count"),
        (lambda c: c["spec"]["devices"]["requests"][0].update(firstAvailable=[]), "exactly one"),
        (
            lambda c: c["spec"]["devices"]["requests"][0]["exactly"].update(allocationMode="Some"),
            "allocationMode",
        ),
        (lambda c: c["spec"]["devices"].update(requests="x"), "must be a list"),
    ],
)
def test_bad_claims_are_refused_with_a_reason(mutate: Any, message: str) -> None:
    obj = claim(exactly())
    mutate(obj)
    with pytest.raises(AllocationError, match=message):
        allocate(obj, NODE, [node_slice(card("gpu-0"))], [], CLASSES)


def test_bad_capacity_in_a_slice_or_an_allocation_is_refused() -> None:
    broken = card("gpu-0")
    broken["capacity"][MEMORY]["value"] = "lots"
    with pytest.raises(AllocationError, match="memory"):
        allocate(claim(exactly()), NODE, [node_slice(broken)], [], CLASSES)
    held = {
        "devices": {
            "results": [
                {
                    "request": "m",
                    "driver": DRIVER,
                    "pool": NODE,
                    "device": "gpu-0",
                    "shareID": "x",
                    "consumedCapacity": {MEMORY: "-1"},
                }
            ]
        }
    }
    with pytest.raises(AllocationError, match="negative"):
        allocate(claim(exactly()), NODE, [node_slice(card("gpu-0"))], [held], CLASSES)


def test_a_shared_device_without_capacity_gets_a_share_id_only() -> None:
    bare = {"name": "gpu-0", "allowMultipleAllocations": True}
    slices = [node_slice(bare)]
    first = allocated(claim(exactly()), slices=slices)
    second = allocated(claim(exactly()), *(a for a in [first] if a), slices=slices)
    for answer in (first, second):
        assert answer is not None
        (result,) = answer["devices"]["results"]
        assert "consumedCapacity" not in result
        assert result["shareID"]
    assert first is not None
    assert second is not None
    assert first["devices"]["results"][0]["shareID"] != second["devices"]["results"][0]["shareID"]
