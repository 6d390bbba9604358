"""Property tests: reading GPU requests fails only with RequestError and keeps its invariants."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuslice_common.config import RequestDefaults, RequestSettings
from gpuslice_common.models import PodGpuRequest
from gpuslice_common.requests import MAX_POD_GPU_COUNT, RequestError, parse_pod, parse_quantity

NAMES = RequestSettings().resources
GPU_RESOURCES = NAMES.all()
EXAMPLES = settings(max_examples=200, deadline=None)

# ---------------------------------------------------------------- strategies

quantity_text = st.from_regex(
    r"[+-]?([0-9]{1,4}(\.[0-9]{0,3})?|\.[0-9]{1,3})([eE][+-]?[0-9]{1,3}|[KMGTPE]i|[numkMGTPE])?",
    fullmatch=True,
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    quantity_text,
)
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.text(max_size=10), children, max_size=4),
    ),
    max_leaves=12,
)
resource_keys = st.one_of(st.sampled_from(GPU_RESOURCES), st.text(max_size=12))
resource_values = st.one_of(
    json_values,
    st.integers(min_value=-2, max_value=130),
    st.sampled_from(["0", "1", "2", "50", "100", "101", "1k", "1Ki", "1.5", "500m", "-1"]),
)
resource_maps = st.dictionaries(resource_keys, resource_values, max_size=6)


def mostly(usual: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Draw from ``usual`` three times in four, else from ``odd``."""
    return st.sampled_from([usual, usual, usual, odd]).flatmap(lambda strategy: strategy)


def _outcome(pod: Any) -> PodGpuRequest | None:
    """parse_pod's result, or None when it rejects the pod with RequestError."""
    try:
        return parse_pod(pod)
    except RequestError:
        return None


# ---------------------------------------------------------------- (1) arbitrary resource maps


@EXAMPLES
@given(
    limits=st.one_of(resource_maps, json_values),
    requests=st.one_of(resource_maps, json_values),
    name=st.one_of(st.sampled_from(["train", "eval"]), json_values),
)
def test_arbitrary_resources_only_raise_request_error(
    limits: Any, requests: Any, name: Any
) -> None:
    pod = {
        "metadata": {"name": "p", "uid": "u"},
        "spec": {
            "containers": [{"name": name, "resources": {"limits": limits, "requests": requests}}]
        },
    }
    result = _outcome(pod)
    assert result is None or isinstance(result, PodGpuRequest)


@EXAMPLES
@given(st.one_of(quantity_text, st.text(max_size=40), st.integers(), scalars))
def test_parse_quantity_only_raises_request_error(value: object) -> None:
    try:
        result = parse_quantity(value)
    except RequestError:
        return
    assert isinstance(result, Decimal)
    assert result.is_finite()


@EXAMPLES
@given(st.integers(min_value=0, max_value=10**12), st.sampled_from(["", "k", "Ki", "Mi", "e2"]))
def test_quantity_integers_round_trip(number: int, suffix: str) -> None:
    scale = {"": 1, "k": 1000, "Ki": 1024, "Mi": 1024**2, "e2": 100}[suffix]
    assert parse_quantity(f"{number}{suffix}") == number * scale


# ---------------------------------------------------------------- (2) valid inputs keep invariants


@st.composite
def gpu_limits(draw: st.DrawFn) -> dict[str, Any]:
    """A well-formed, in-bounds set of GPU resources (possibly none)."""
    as_text = draw(st.booleans())
    limits: dict[str, Any] = {}
    candidates = {
        NAMES.gpu: st.integers(1, 64),
        NAMES.memory: st.integers(0, 2**31),
        NAMES.memory_percentage: st.integers(0, 100),
        NAMES.cores: st.integers(0, 100),
    }
    for resource, values in candidates.items():
        if draw(st.booleans()):
            value = draw(values)
            limits[resource] = str(value) if as_text else value
    with_priority = draw(st.booleans())
    if limits and with_priority:  # priority alone, without any GPU, is an error
        limits[NAMES.priority] = draw(st.integers(0, 1))
    return limits


@st.composite
def containers(draw: st.DrawFn, prefix: str) -> list[dict[str, Any]]:
    count = draw(st.integers(0, 4))
    result = []
    for index in range(count):
        limits = draw(gpu_limits())
        field = draw(st.sampled_from(["limits", "requests"]))
        result.append({"name": f"{prefix}-{index}", "resources": {field: limits}})
    return result


request_settings = st.builds(
    RequestSettings,
    defaults=st.builds(
        RequestDefaults,
        gpu_count=st.integers(1, 64),
        memory_mib=st.integers(0, 2**20),
        cores=st.integers(0, 100),
        priority=st.integers(0, 1),
    ),
)


@EXAMPLES
@given(init=containers("init"), app=containers("app"), config=request_settings)
def test_valid_requests_keep_invariants(
    init: list[dict[str, Any]], app: list[dict[str, Any]], config: RequestSettings
) -> None:
    pod = {
        "metadata": {"namespace": "ns", "name": "p"},
        "spec": {"initContainers": init, "containers": app},
    }

    def asked(container: dict[str, Any]) -> bool:
        (amounts,) = container["resources"].values()
        return bool(amounts)

    def cards(container: dict[str, Any]) -> int:
        (amounts,) = container["resources"].values()
        return int(amounts.get(NAMES.gpu, config.defaults.gpu_count))

    expected_names = [c["name"] for c in init + app if asked(c)]
    total = sum(cards(c) for c in init + app if asked(c))
    if total > MAX_POD_GPU_COUNT:  # valid containers, but too many cards for one pod
        with pytest.raises(RequestError, match=f"ask for {total} GPUs together"):
            parse_pod(pod, config)
        return
    result = parse_pod(pod, config)
    if not expected_names:
        assert result is None
        return
    assert result is not None
    assert [c.name for c in result.containers] == expected_names
    assert [c.init for c in result.containers] == sorted(
        (c.init for c in result.containers), reverse=True
    )
    assert all(c.init == c.name.startswith("init-") for c in result.containers)
    assert result.pod.uid == "ns/p"
    sources = {c["name"]: next(iter(c["resources"].values())) for c in init + app}
    for request in result.containers:
        given_amounts = {k: int(v) for k, v in sources[request.name].items()}
        assert 1 <= request.count <= 64
        assert 0 <= request.cores <= 100
        assert (request.memory.mib is None) != (request.memory.percent is None)
        assert request.exclusive == (request.cores == 100)
        assert request.priority in (0, 1)
        if NAMES.gpu in given_amounts:
            assert request.count == given_amounts[NAMES.gpu]
        if NAMES.cores in given_amounts:
            assert request.cores == given_amounts[NAMES.cores]
        mib, percent = (
            given_amounts.get(NAMES.memory, 0),
            given_amounts.get(NAMES.memory_percentage, 0),
        )
        if mib > 0:
            assert request.memory.mib == mib
        elif percent > 0:
            assert request.memory.percent == percent
        else:  # 0 is "not set": a default, never a limit of 0 MiB (no limit)
            whole = request.memory.percent == 100
            assert whole or request.memory.mib == config.defaults.memory_mib > 0
        memory_named = NAMES.memory in given_amounts or NAMES.memory_percentage in given_amounts
        if NAMES.cores not in given_amounts:  # HAMi's webhook: whole memory, or none named
            exclusive = (
                given_amounts.get(NAMES.memory_percentage) == 100
                if NAMES.memory_percentage in given_amounts
                else NAMES.memory not in given_amounts
            )
            assert request.exclusive == exclusive or request.cores == config.defaults.cores == 100
        if NAMES.gpu in given_amounts and not memory_named and NAMES.cores not in given_amounts:
            assert request.exclusive
            assert request.memory.percent == 100
    both = sum(
        1
        for request in result.containers
        if int(sources[request.name].get(NAMES.memory, 0)) > 0
        and int(sources[request.name].get(NAMES.memory_percentage, 0)) > 0
    )
    assert len(result.warnings) == both


# ---------------------------------------------------------------- (3) arbitrary JSON-like pods

resources_like = mostly(
    st.fixed_dictionaries(
        {"limits": mostly(resource_maps, json_values)},
        optional={"requests": mostly(resource_maps, json_values)},
    ),
    json_values,
)
container_like = mostly(
    st.fixed_dictionaries(
        {
            "name": mostly(st.from_regex(r"[a-z][a-z0-9-]{0,8}", fullmatch=True), json_values),
            "resources": resources_like,
        },
        optional={"image": json_values},
    ),
    json_values,
)
spec_like = mostly(
    st.fixed_dictionaries(
        {},
        optional={
            "containers": mostly(st.lists(container_like, max_size=3), json_values),
            "initContainers": mostly(st.lists(container_like, max_size=2), json_values),
        },
    ),
    json_values,
)
annotation_keys = st.sampled_from(
    [
        "nvidia.com/use-gputype",
        "gpuslice.io/nouse-gpuuuid",
        "nvidia.com/numa-bind",
        "gpuslice.io/vgpu-mode",
        "hami.io/gpu-scheduler-policy",
        "gpuslice.io/node-scheduler-policy",
    ]
)
metadata_like = mostly(
    st.fixed_dictionaries(
        {},
        optional={
            "uid": mostly(st.text(max_size=140), json_values),
            "name": mostly(st.text(max_size=140), json_values),
            "generateName": mostly(st.text(max_size=140), json_values),
            "namespace": mostly(st.text(max_size=140), json_values),
            "labels": json_values,
            "annotations": mostly(
                st.dictionaries(annotation_keys, mostly(st.text(max_size=20), json_values)),
                json_values,
            ),
        },
    ),
    json_values,
)
pod_like = mostly(
    st.fixed_dictionaries(
        {"spec": spec_like}, optional={"metadata": metadata_like, "kind": json_values}
    ),
    json_values,
)


@EXAMPLES
@given(pod_like)
def test_arbitrary_pods_only_raise_request_error(pod: Any) -> None:
    result = _outcome(pod)
    assert result is None or isinstance(result, PodGpuRequest)


@EXAMPLES
@given(
    metadata=metadata_like,
    limits=st.fixed_dictionaries({NAMES.gpu: st.integers(1, 4)}),
)
def test_arbitrary_metadata_on_a_gpu_pod_only_raises_request_error(
    metadata: Any, limits: dict[str, Any]
) -> None:
    pod = {
        "metadata": metadata,
        "spec": {"containers": [{"name": "c", "resources": {"limits": limits}}]},
    }
    result = _outcome(pod)
    assert result is None or len(result.pod.uid) <= 128
