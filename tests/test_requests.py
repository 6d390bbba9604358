"""Table tests for reading pods' GPU requests (HAMi-compatible)."""

from __future__ import annotations

import time
from decimal import Decimal
from typing import Any

import pytest

from gpuslice_common.config import RequestDefaults, RequestSettings, ResourceNames
from gpuslice_common.models import (
    ContainerGpuRequest,
    DeviceSelector,
    GpuPolicy,
    MemoryRequest,
    NodePolicy,
    PodGpuRequest,
    PodRef,
    ScoringWeights,
    VgpuMode,
)
from gpuslice_common.requests import (
    ANNOTATIONS,
    QuantityTooLarge,
    RequestError,
    asks_for_gpus,
    has_gpu_request,
    parse_container,
    parse_pod,
    parse_quantity,
)

GPU = "nvidia.com/gpu"
MEM = "nvidia.com/gpumem"
PCT = "nvidia.com/gpumem-percentage"
CORES = "nvidia.com/gpucores"
PRIO = "nvidia.com/priority"

REF = PodRef(uid="3f1c-uid", namespace="ml", name="train-0")
WHOLE = MemoryRequest(percent=100)


def ctr(
    name: str = "train",
    limits: dict[str, Any] | None = None,
    requests: dict[str, Any] | None = None,
    image: str = "pytorch/pytorch:2.4.0-cuda12.4-cudnn9-runtime",
) -> dict[str, Any]:
    """A container in Kubernetes JSON shape."""
    resources: dict[str, Any] = {}
    if limits is not None:
        resources["limits"] = limits
    if requests is not None:
        resources["requests"] = requests
    return {"name": name, "image": image, "resources": resources}


def pod(
    *containers: dict[str, Any],
    init: tuple[dict[str, Any], ...] = (),
    annotations: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A pod in Kubernetes JSON shape, as a webhook receives it."""
    metadata: dict[str, Any] = {
        "name": "train-0",
        "namespace": "ml",
        "uid": "3f1c-uid",
        "labels": {"app": "train"},
    }
    if annotations is not None:
        metadata["annotations"] = annotations
    spec: dict[str, Any] = {"containers": list(containers), "restartPolicy": "Never"}
    if init:
        spec["initContainers"] = list(init)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def want(
    *containers: ContainerGpuRequest,
    selector: DeviceSelector | None = None,
    warnings: tuple[str, ...] = (),
    **fields: Any,
) -> PodGpuRequest:
    return PodGpuRequest(
        pod=REF,
        containers=containers,
        selector=selector or DeviceSelector(),
        warnings=warnings,
        **fields,
    )


def req(
    name: str = "train",
    count: int = 1,
    memory: MemoryRequest = WHOLE,
    cores: int = 0,
    priority: int = 1,
    init: bool = False,
) -> ContainerGpuRequest:
    return ContainerGpuRequest(
        name=name, init=init, count=count, memory=memory, cores=cores, priority=priority
    )


CUSTOM_NAMES = RequestSettings(
    resources=ResourceNames(
        gpu="example.com/vgpu",
        memory="example.com/vgpu-memory",
        memory_percentage="example.com/vgpu-memory-percentage",
        cores="example.com/vgpu-cores",
        priority="example.com/vgpu-priority",
    )
)
SITE_DEFAULTS = RequestSettings(
    defaults=RequestDefaults(gpu_count=2, memory_mib=4096, cores=30, priority=0)
)

# ---------------------------------------------------------------- successful parses

SUCCESS_CASES: list[tuple[str, dict[str, Any], RequestSettings, PodGpuRequest]] = [
    (
        "count-only-is-exclusive",
        pod(ctr(limits={GPU: 1})),
        RequestSettings(),
        want(req(cores=100)),
    ),
    (
        "count-only-two-cards",
        pod(ctr(limits={GPU: "2"})),
        RequestSettings(),
        want(req(count=2, cores=100)),
    ),
    (
        "gpumem-with-count",
        pod(ctr(limits={GPU: 1, MEM: "3000"})),
        RequestSettings(),
        want(req(memory=MemoryRequest(mib=3000))),
    ),
    (
        "gpumem-quantity-suffix",
        pod(ctr(limits={GPU: 1, MEM: "1k"})),
        RequestSettings(),
        want(req(memory=MemoryRequest(mib=1000))),
    ),
    (
        "percentage",
        pod(ctr(limits={GPU: 2, PCT: 50})),
        RequestSettings(),
        want(req(count=2, memory=MemoryRequest(percent=50))),
    ),
    (
        "percentage-zero-means-unset",
        pod(ctr(limits={GPU: 1, PCT: 0, CORES: 10})),
        RequestSettings(),
        want(req(cores=10)),
    ),
    (
        "percentage-zero-takes-default-mem",
        pod(ctr(limits={GPU: 1, PCT: 0, CORES: 10})),
        SITE_DEFAULTS,
        want(req(memory=MemoryRequest(mib=4096), cores=10, priority=0)),
    ),
    (
        "percentage-zero-with-count-is-not-exclusive",
        pod(ctr(limits={GPU: 1, PCT: 0})),
        RequestSettings(),
        want(req()),
    ),
    (
        "gpumem-and-percentage-zero-take-default-mem",
        pod(ctr(limits={GPU: 1, MEM: 0, PCT: 0})),
        SITE_DEFAULTS,
        want(req(memory=MemoryRequest(mib=4096), cores=30, priority=0)),
    ),
    (
        "percentage-zero-alone-gets-default-count",
        pod(ctr(requests={PCT: "0"})),
        RequestSettings(),
        want(req()),
    ),
    (
        "percentage-100-without-cores-is-exclusive",
        pod(ctr(limits={GPU: 2, PCT: 100})),
        RequestSettings(),
        want(req(count=2, cores=100)),
    ),
    (
        "percentage-100-alone-is-exclusive-with-default-count",
        pod(ctr(limits={PCT: 100})),
        SITE_DEFAULTS,
        want(req(count=2, cores=100, priority=0)),
    ),
    (
        "percentage-100-keeps-its-cores",
        pod(ctr(limits={GPU: 1, PCT: 100, CORES: 30})),
        RequestSettings(),
        want(req(cores=30)),
    ),
    (
        "percentage-100-keeps-cores-zero",
        pod(ctr(limits={GPU: 1, PCT: 100, CORES: 0})),
        RequestSettings(),
        want(req()),
    ),
    (
        "percentage-100-with-gpumem-is-exclusive",
        pod(ctr(limits={GPU: 1, MEM: 2048, PCT: 100})),
        RequestSettings(),
        want(
            req(memory=MemoryRequest(mib=2048), cores=100),
            warnings=(
                "container 'train': nvidia.com/gpumem-percentage is ignored "
                "because nvidia.com/gpumem is set",
            ),
        ),
    ),
    (
        "percentage-99-is-not-exclusive",
        pod(ctr(limits={GPU: 1, PCT: 99})),
        SITE_DEFAULTS,
        want(req(memory=MemoryRequest(percent=99), cores=30, priority=0)),
    ),
    (
        "cores-only-gets-default-count",
        pod(ctr(limits={CORES: 30})),
        RequestSettings(),
        want(req(cores=30)),
    ),
    (
        "cores-100-is-exclusive",
        pod(ctr(limits={GPU: 1, MEM: 8000, CORES: 100})),
        RequestSettings(),
        want(req(memory=MemoryRequest(mib=8000), cores=100)),
    ),
    (
        "gpumem-zero-means-unset",
        pod(ctr(limits={GPU: 1, MEM: 0, CORES: 20})),
        RequestSettings(),
        want(req(cores=20)),
    ),
    (
        "gpumem-zero-with-count-is-not-exclusive",
        pod(ctr(limits={GPU: 1, MEM: 0})),
        SITE_DEFAULTS,
        want(req(memory=MemoryRequest(mib=4096), cores=30, priority=0)),
    ),
    (
        "gpumem-wins-over-percentage",
        pod(ctr(limits={GPU: 1, MEM: 2048, PCT: 50, CORES: 25})),
        RequestSettings(),
        want(
            req(memory=MemoryRequest(mib=2048), cores=25),
            warnings=(
                "container 'train': nvidia.com/gpumem-percentage is ignored "
                "because nvidia.com/gpumem is set",
            ),
        ),
    ),
    (
        "default-gpu-num-from-memory",
        pod(ctr(limits={MEM: 1024})),
        SITE_DEFAULTS,
        want(req(count=2, memory=MemoryRequest(mib=1024), cores=30, priority=0)),
    ),
    (
        "default-mem-and-cores",
        pod(ctr(limits={GPU: 1, CORES: 10})),
        SITE_DEFAULTS,
        want(req(memory=MemoryRequest(mib=4096), cores=10, priority=0)),
    ),
    (
        "default-cores-with-percentage",
        pod(ctr(limits={PCT: 25})),
        SITE_DEFAULTS,
        want(req(count=2, memory=MemoryRequest(percent=25), cores=30, priority=0)),
    ),
    (
        "count-only-ignores-site-defaults",
        pod(ctr(limits={GPU: 1})),
        SITE_DEFAULTS,
        want(req(cores=100, priority=0)),
    ),
    (
        "gpumem-zero-alone-uses-defaults",
        pod(ctr(limits={MEM: 0})),
        RequestSettings(),
        want(req()),
    ),
    (
        "priority-high",
        pod(ctr(limits={GPU: 1, MEM: 1000, PRIO: 0})),
        RequestSettings(),
        want(req(memory=MemoryRequest(mib=1000), priority=0)),
    ),
    (
        "priority-with-count-only-stays-exclusive",
        pod(ctr(limits={GPU: 1, PRIO: "1"})),
        RequestSettings(),
        want(req(cores=100)),
    ),
    (
        "requests-only",
        pod(ctr(requests={GPU: 1, MEM: "4000", CORES: "40"})),
        RequestSettings(),
        want(req(memory=MemoryRequest(mib=4000), cores=40)),
    ),
    (
        "limits-and-requests-equal",
        pod(ctr(limits={GPU: 1, MEM: 4000}, requests={GPU: "1", MEM: "4k", CORES: 5})),
        RequestSettings(),
        want(req(memory=MemoryRequest(mib=4000), cores=5)),
    ),
    (
        "multi-container-skips-cpu-only",
        pod(
            ctr("train", limits={GPU: 1, MEM: 10000, CORES: 50}),
            ctr("sidecar", limits={"cpu": "500m", "memory": "128Mi"}),
            ctr("eval", limits={GPU: 1, PCT: 20}),
        ),
        RequestSettings(),
        want(
            req("train", memory=MemoryRequest(mib=10000), cores=50),
            req("eval", memory=MemoryRequest(percent=20)),
        ),
    ),
    (
        "init-containers-first",
        pod(
            ctr("serve", limits={GPU: 1, MEM: 2000}),
            init=(
                ctr("warmup", limits={GPU: 1, MEM: 1000}),
                ctr("fetch", limits={"cpu": "1"}),
                ctr("compile", limits={GPU: 2, CORES: 100}),
            ),
        ),
        RequestSettings(),
        want(
            req("warmup", memory=MemoryRequest(mib=1000), init=True),
            req("compile", count=2, cores=100, init=True),
            req("serve", memory=MemoryRequest(mib=2000)),
        ),
    ),
    (
        "gpu-zero-alone-in-one-container",
        pod(ctr("a", limits={GPU: 0}), ctr("b", limits={GPU: 1, MEM: 500})),
        RequestSettings(),
        want(req("b", memory=MemoryRequest(mib=500))),
    ),
    (
        "custom-resource-names",
        pod(
            ctr(
                limits={
                    "example.com/vgpu": 1,
                    "example.com/vgpu-memory": 1500,
                    "example.com/vgpu-cores": 20,
                    "example.com/vgpu-priority": 0,
                    GPU: 4,
                }
            )
        ),
        CUSTOM_NAMES,
        want(req(memory=MemoryRequest(mib=1500), cores=20, priority=0)),
    ),
    (
        "custom-names-count-only",
        pod(ctr(limits={"example.com/vgpu": "3"})),
        CUSTOM_NAMES,
        want(req(count=3, cores=100)),
    ),
    (
        "selector-hami-annotations",
        pod(
            ctr(limits={GPU: 1}),
            annotations={
                "nvidia.com/use-gputype": "A100, H100 ,,",
                "nvidia.com/nouse-gputype": "MIG",
                "nvidia.com/use-gpuuuid": "GPU-aaa,GPU-bbb",
                "nvidia.com/nouse-gpuuuid": " GPU-ccc ",
                "nvidia.com/numa-bind": "True",
            },
        ),
        RequestSettings(),
        want(
            req(cores=100),
            selector=DeviceSelector(
                include_types=("A100", "H100"),
                exclude_types=("MIG",),
                include_uuids=("GPU-aaa", "GPU-bbb"),
                exclude_uuids=("GPU-ccc",),
                numa_bind=True,
            ),
        ),
    ),
    (
        "selector-gpuslice-annotations-win",
        pod(
            ctr(limits={GPU: 1}),
            annotations={
                "nvidia.com/use-gputype": "A100",
                "gpuslice.io/use-gputype": "H100",
                "nvidia.com/numa-bind": "true",
                "gpuslice.io/numa-bind": "FALSE",
                "gpuslice.io/nouse-gpuuuid": "GPU-x",
            },
        ),
        RequestSettings(),
        want(
            req(cores=100),
            selector=DeviceSelector(include_types=("H100",), exclude_uuids=("GPU-x",)),
        ),
    ),
    (
        "blank-gpuslice-annotation-wins-as-unset",
        pod(
            ctr(limits={GPU: 1}),
            annotations={"nvidia.com/use-gputype": "A100", "gpuslice.io/use-gputype": " "},
        ),
        RequestSettings(),
        want(req(cores=100)),
    ),
    (
        "policies-hami-form",
        pod(
            ctr(limits={GPU: 1, MEM: 1000}),
            annotations={
                "hami.io/gpu-scheduler-policy": "binpack",
                "hami.io/node-scheduler-policy": "spread",
            },
        ),
        RequestSettings(),
        want(
            req(memory=MemoryRequest(mib=1000)),
            gpu_policy=GpuPolicy.BINPACK,
            node_policy=NodePolicy.SPREAD,
        ),
    ),
    (
        "policies-gpuslice-form-wins",
        pod(
            ctr(limits={GPU: 1, MEM: 1000}),
            annotations={
                "hami.io/gpu-scheduler-policy": "spread",
                "gpuslice.io/gpu-scheduler-policy": "fragmentation",
                "hami.io/node-scheduler-policy": "spread",
                "gpuslice.io/node-scheduler-policy": "Binpack",
            },
        ),
        RequestSettings(),
        want(
            req(memory=MemoryRequest(mib=1000)),
            gpu_policy=GpuPolicy.FRAGMENTATION,
            node_policy=NodePolicy.BINPACK,
        ),
    ),
    (
        "policy-topology-aware-compat",
        pod(ctr(limits={GPU: 1}), annotations={"hami.io/gpu-scheduler-policy": "topology-aware"}),
        RequestSettings(),
        want(
            req(cores=100),
            warnings=(
                "annotation hami.io/gpu-scheduler-policy='topology-aware' is accepted for "
                "HAMi compatibility; using the default GPU policy",
            ),
        ),
    ),
    (
        "policy-numa-compat-binds-numa",
        pod(ctr(limits={GPU: 2}), annotations={"hami.io/gpu-scheduler-policy": "numa"}),
        RequestSettings(),
        want(
            req(count=2, cores=100),
            selector=DeviceSelector(numa_bind=True),
            warnings=(
                "annotation hami.io/gpu-scheduler-policy='numa' is accepted for "
                "HAMi compatibility; using the default GPU policy with NUMA binding",
            ),
        ),
    ),
    (
        "vgpu-mode-mig",
        pod(ctr(limits={GPU: 1}), annotations={"nvidia.com/vgpu-mode": "mig"}),
        RequestSettings(),
        want(req(cores=100), vgpu_mode=VgpuMode.MIG),
    ),
    (
        "vgpu-mode-gpuslice-wins",
        pod(
            ctr(limits={GPU: 1}),
            annotations={"nvidia.com/vgpu-mode": "mig", "gpuslice.io/vgpu-mode": "hami-core"},
        ),
        RequestSettings(),
        want(req(cores=100), vgpu_mode=VgpuMode.HAMI_CORE),
    ),
    (
        "scoring-weights-hami",
        pod(
            ctr(limits={GPU: 1}),
            annotations={"hami.io/device-scoring-weights": "slot=1,core=1,memory=3"},
        ),
        RequestSettings(),
        want(req(cores=100), scoring_weights=ScoringWeights(slot=1, core=1, memory=3)),
    ),
    (
        "scoring-weights-any-order-spaces-and-zeros",
        pod(
            ctr(limits={GPU: 1}),
            annotations={"hami.io/device-scoring-weights": " memory = 0 , slot=+2,core=0 "},
        ),
        RequestSettings(),
        want(req(cores=100), scoring_weights=ScoringWeights(slot=2, core=0, memory=0)),
    ),
    (
        "scoring-weights-gpuslice-wins",
        pod(
            ctr(limits={GPU: 1}),
            annotations={
                "hami.io/device-scoring-weights": "bogus",
                "gpuslice.io/device-scoring-weights": "slot=0,core=5,memory=1",
            },
        ),
        RequestSettings(),
        want(req(cores=100), scoring_weights=ScoringWeights(slot=0, core=5, memory=1)),
    ),
    (
        "scoring-weights-blank-is-unset",
        pod(ctr(limits={GPU: 1}), annotations={"hami.io/device-scoring-weights": "  "}),
        RequestSettings(),
        want(req(cores=100)),
    ),
    (
        "unrelated-annotations-ignored",
        pod(ctr(limits={GPU: 1}), annotations={"kubectl.kubernetes.io/restartedAt": "now"}),
        RequestSettings(),
        want(req(cores=100)),
    ),
]


@pytest.mark.parametrize(
    ("manifest", "settings", "expected"),
    [pytest.param(m, s, e, id=i) for i, m, s, e in SUCCESS_CASES],
)
def test_parse_pod(
    manifest: dict[str, Any], settings: RequestSettings, expected: PodGpuRequest
) -> None:
    assert parse_pod(manifest, settings) == expected


# ---------------------------------------------------------------- pods without GPUs

NO_GPU_CASES: list[tuple[str, dict[str, Any], RequestSettings]] = [
    ("cpu-only", pod(ctr(limits={"cpu": "2", "memory": "4Gi"})), RequestSettings()),
    ("no-resources", pod({"name": "web", "image": "nginx"}), RequestSettings()),
    ("null-resources", pod({"name": "web", "resources": None}), RequestSettings()),
    ("empty-spec", {"metadata": {"name": "x"}, "spec": {}}, RequestSettings()),
    ("no-spec", {"metadata": {"name": "x"}}, RequestSettings()),
    ("gpu-zero-alone", pod(ctr(limits={GPU: "0"})), RequestSettings()),
    ("other-vendor-names", pod(ctr(limits={GPU: 1})), CUSTOM_NAMES),
    (
        "bad-annotations-ignored-without-gpu",
        pod(ctr(limits={"cpu": "1"}), annotations={"nvidia.com/vgpu-mode": "bogus"}),
        RequestSettings(),
    ),
]


@pytest.mark.parametrize(
    ("manifest", "settings"), [pytest.param(m, s, id=i) for i, m, s in NO_GPU_CASES]
)
def test_pod_without_gpu(manifest: dict[str, Any], settings: RequestSettings) -> None:
    assert parse_pod(manifest, settings) is None


# ---------------------------------------------------------------- rejected pods


def weights(value: str) -> dict[str, Any]:
    return pod(ctr(limits={GPU: 1}), annotations={"hami.io/device-scoring-weights": value})


SCORING = "annotation hami.io/device-scoring-weights="

ERROR_CASES: list[tuple[str, dict[str, Any], RequestSettings, tuple[str, ...]]] = [
    (
        "weights-two-parts",
        weights("slot=1,core=1"),
        RequestSettings(),
        (SCORING, "expected slot, core and memory weights"),
    ),
    (
        "weights-four-parts",
        weights("slot=1,core=1,memory=1,slot=1"),
        RequestSettings(),
        (SCORING, "expected slot, core and memory weights"),
    ),
    ("weights-no-equals", weights("slot=1,core,memory=1"), RequestSettings(), ("key=value",)),
    (
        "weights-unknown-key",
        weights("slot=1,cores=1,memory=1"),
        RequestSettings(),
        (SCORING, "unknown weight 'cores'"),
    ),
    (
        "weights-duplicate",
        weights("slot=1,slot=2,memory=1"),
        RequestSettings(),
        (SCORING, "duplicate 'slot' weight"),
    ),
    (
        "weights-not-integer",
        weights("slot=1,core=1.5,memory=1"),
        RequestSettings(),
        (SCORING, "'core' weight must be a whole number"),
    ),
    (
        "weights-unicode-digits",
        weights("slot=1,core=\u0661,memory=1"),
        RequestSettings(),
        (SCORING, "'core' weight must be a whole number"),
    ),
    (
        "weights-negative",
        weights("slot=1,core=1,memory=-1"),
        RequestSettings(),
        (SCORING, "'memory' weight must be between 0 and 1000000000"),
    ),
    (
        "weights-huge",
        weights("slot=1,core=1,memory=99999999999"),
        RequestSettings(),
        (SCORING, "'memory' weight must be between 0 and 1000000000"),
    ),
    (
        "weights-exponent",
        weights("slot=1e999,core=1,memory=1"),
        RequestSettings(),
        (SCORING, "'slot' weight must be a whole number"),
    ),
    (
        "weights-not-a-number",
        weights("slot=1,core=nan,memory=inf"),
        RequestSettings(),
        (SCORING, "'core' weight must be a whole number"),
    ),
    (
        "weights-all-zero",
        weights("slot=0,core=0,memory=0"),
        RequestSettings(),
        (SCORING, "at least one weight must be positive"),
    ),
    (
        "weights-endless",
        weights("slot=1,core=1,memory=" + "9" * 5000),
        RequestSettings(),
        (SCORING, "'memory' weight must be a whole number"),
    ),
    ("negative-gpu", pod(ctr(limits={GPU: -1})), RequestSettings(), ("'train'", GPU, "negative")),
    (
        "negative-gpumem",
        pod(ctr(limits={GPU: 1, MEM: "-100"})),
        RequestSettings(),
        ("'train'", MEM, "must not be negative, got -100"),
    ),
    (
        "fractional-gpu",
        pod(ctr(limits={GPU: "1.5"})),
        RequestSettings(),
        ("'train'", GPU, "must be a whole number, got 1.5"),
    ),
    (
        "milli-gpu",
        pod(ctr(limits={GPU: "500m"})),
        RequestSettings(),
        ("'train'", GPU, "whole number"),
    ),
    (
        "fractional-cores",
        pod(ctr(limits={GPU: 1, CORES: "10.5"})),
        RequestSettings(),
        ("'train'", CORES, "whole number"),
    ),
    (
        "percentage-over-100",
        pod(ctr(limits={GPU: 1, PCT: 150})),
        RequestSettings(),
        ("container 'train': nvidia.com/gpumem-percentage must be between 0 and 100, got 150",),
    ),
    (
        "cores-over-100",
        pod(ctr(limits={GPU: 1, CORES: "101"})),
        RequestSettings(),
        ("'train'", CORES, "between 0 and 100"),
    ),
    (
        "gpu-over-64",
        pod(ctr(limits={GPU: 65})),
        RequestSettings(),
        ("'train'", GPU, "between 0 and 64"),
    ),
    (
        "gpumem-absurd",
        pod(ctr(limits={GPU: 1, MEM: "3Gi"})),
        RequestSettings(),
        ("'train'", MEM, "between 0 and 2147483648"),
    ),
    ("priority-2", pod(ctr(limits={GPU: 1, PRIO: 2})), RequestSettings(), ("'train'", PRIO, "2")),
    (
        "priority-without-gpu",
        pod(ctr(limits={PRIO: 0})),
        RequestSettings(),
        ("'train'", PRIO, "no GPU"),
    ),
    (
        "garbage-string",
        pod(ctr(limits={GPU: 1, MEM: "lots"})),
        RequestSettings(),
        ("'train'", MEM, "invalid value", "'lots'"),
    ),
    (
        "float-value",
        pod(ctr(limits={GPU: 1.0})),
        RequestSettings(),
        ("'train'", GPU, "must be a string or an integer, got a number"),
    ),
    (
        "bool-value",
        pod(ctr(limits={GPU: True})),
        RequestSettings(),
        ("'train'", GPU, "got a boolean"),
    ),
    (
        "null-value",
        pod(ctr(requests={CORES: None})),
        RequestSettings(),
        ("'train'", CORES, "null"),
    ),
    (
        "huge-exponent",
        pod(ctr(limits={GPU: 1, MEM: "1e999999999"})),
        RequestSettings(),
        ("'train'", MEM, "exponent"),
    ),
    (
        "limits-requests-differ",
        pod(ctr(limits={GPU: 1, MEM: 1000}, requests={GPU: 1, MEM: 2000})),
        RequestSettings(),
        ("'train'", MEM, "requests and limits differ"),
    ),
    (
        "gpu-zero-with-memory",
        pod(ctr(limits={GPU: 0, MEM: 1000})),
        RequestSettings(),
        ("'train'", GPU, MEM, "is 0"),
    ),
    (
        "gpu-zero-with-cores-and-percentage",
        pod(ctr(limits={GPU: 0, PCT: 10, CORES: 10})),
        RequestSettings(),
        ("'train'", GPU, PCT, CORES),
    ),
    (
        "resources-not-object",
        pod({"name": "train", "resources": ["limits"]}),
        RequestSettings(),
        ("'train'", "resources must be an object"),
    ),
    (
        "limits-not-object",
        pod({"name": "train", "resources": {"limits": "nvidia.com/gpu=1"}}),
        RequestSettings(),
        ("'train'", "resources.limits must be an object"),
    ),
    (
        "duplicate-names-across-init",
        pod(ctr("train", limits={GPU: 1}), init=(ctr("train", limits={"cpu": "1"}),)),
        RequestSettings(),
        ("'train'", "another container"),
    ),
    (
        "missing-container-name",
        pod({"resources": {"limits": {GPU: 1}}}),
        RequestSettings(),
        ("spec.containers[0]", "name"),
    ),
    (
        "empty-init-container-name",
        pod(ctr(limits={GPU: 1}), init=(ctr("", limits={GPU: 1}),)),
        RequestSettings(),
        ("spec.initContainers[0]", "name"),
    ),
    (
        "container-not-object",
        pod("train"),  # type: ignore[arg-type]
        RequestSettings(),
        ("spec.containers[0]", "object"),
    ),
    (
        "containers-not-list",
        {"spec": {"containers": {"name": "train"}}},
        RequestSettings(),
        ("spec.containers", "must be a list"),
    ),
    ("spec-not-object", {"spec": "x"}, RequestSettings(), ("spec", "must be an object")),
    (
        "custom-names-out-of-range",
        pod(ctr("infer", limits={"example.com/vgpu": 1, "example.com/vgpu-cores": 200})),
        CUSTOM_NAMES,
        ("'infer'", "example.com/vgpu-cores", "between 0 and 100"),
    ),
    (
        "annotation-not-string",
        pod(ctr(limits={GPU: 1}), annotations={"nvidia.com/numa-bind": True}),
        RequestSettings(),
        ("nvidia.com/numa-bind", "must be a string"),
    ),
    (
        "numa-bind-not-boolean",
        pod(ctr(limits={GPU: 1}), annotations={"gpuslice.io/numa-bind": "yes"}),
        RequestSettings(),
        ("gpuslice.io/numa-bind", "'yes'"),
    ),
    (
        "vgpu-mode-unknown",
        pod(ctr(limits={GPU: 1}), annotations={"nvidia.com/vgpu-mode": "vulkan"}),
        RequestSettings(),
        ("nvidia.com/vgpu-mode", "'vulkan'", "hami-core", "mig", "mps"),
    ),
    (
        "gpu-policy-unknown",
        pod(ctr(limits={GPU: 1}), annotations={"hami.io/gpu-scheduler-policy": "random"}),
        RequestSettings(),
        ("hami.io/gpu-scheduler-policy", "'random'", "binpack", "spread", "fragmentation"),
    ),
    (
        "node-policy-unknown",
        pod(ctr(limits={GPU: 1}), annotations={"gpuslice.io/node-scheduler-policy": "numa"}),
        RequestSettings(),
        ("gpuslice.io/node-scheduler-policy", "'numa'", "binpack", "spread"),
    ),
    (
        "annotations-not-object",
        {"metadata": {"annotations": ["a"]}, "spec": {"containers": [ctr(limits={GPU: 1})]}},
        RequestSettings(),
        ("metadata.annotations", "must be an object"),
    ),
    (
        "uid-not-string",
        {"metadata": {"uid": 7}, "spec": {"containers": [ctr(limits={GPU: 1})]}},
        RequestSettings(),
        ("metadata.uid", "must be a string"),
    ),
    (
        "too-many-gpus-over-the-containers",
        {"spec": {"containers": [ctr(f"c{i}", limits={GPU: 32, MEM: 1000}) for i in range(3)]}},
        RequestSettings(),
        ("containers ask for 96 GPUs together", "more than 64"),
    ),
]


def test_a_pod_may_ask_for_64_gpus_over_its_containers() -> None:
    manifest = {"spec": {"containers": [ctr(f"c{i}", limits={GPU: 32, MEM: 1000}) for i in (0, 1)]}}
    request = parse_pod(manifest)
    assert request is not None
    assert sum(c.count for c in request.containers) == 64


@pytest.mark.parametrize(
    ("manifest", "settings", "fragments"),
    [pytest.param(m, s, f, id=i) for i, m, s, f in ERROR_CASES],
)
def test_parse_pod_rejects(
    manifest: dict[str, Any], settings: RequestSettings, fragments: tuple[str, ...]
) -> None:
    with pytest.raises(RequestError) as caught:
        parse_pod(manifest, settings)
    assert type(caught.value) is RequestError
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_pod_not_a_mapping() -> None:
    with pytest.raises(RequestError, match="pod must be an object"):
        parse_pod([])  # type: ignore[arg-type]


# ---------------------------------------------------------------- pod identity


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        pytest.param(
            {"uid": "u-1", "name": "a", "namespace": "ns"},
            PodRef(uid="u-1", namespace="ns", name="a"),
            id="uid",
        ),
        pytest.param(
            {"name": "a", "namespace": "ns"},
            PodRef(uid="ns/a", namespace="ns", name="a"),
            id="name",
        ),
        pytest.param(
            {"generateName": "job-"}, PodRef(uid="default/job-", name=""), id="generate-name"
        ),
        pytest.param({}, PodRef(uid="default/", name=""), id="nothing"),
    ],
)
def test_pod_ref(metadata: dict[str, Any], expected: PodRef) -> None:
    result = parse_pod({"metadata": metadata, "spec": {"containers": [ctr(limits={GPU: 1})]}})
    assert result is not None
    assert result.pod == expected


def test_pod_ref_long_name_is_hashed_to_fit() -> None:
    spec = {"containers": [ctr(limits={GPU: 1})]}
    first = parse_pod({"metadata": {"name": "x" * 200, "namespace": "ns"}, "spec": spec})
    second = parse_pod({"metadata": {"name": "x" * 201, "namespace": "ns"}, "spec": spec})
    assert first is not None
    assert second is not None
    assert len(first.pod.uid) == 128
    assert first.pod.uid.startswith("ns/xxx")
    assert first.pod.uid != second.pod.uid
    assert first.pod.name == "x" * 200


# ---------------------------------------------------------------- single containers


@pytest.mark.parametrize(
    ("container", "init", "expected"),
    [
        pytest.param(ctr(limits={GPU: 1}), False, req(cores=100), id="count-only"),
        pytest.param(
            ctr("w", limits={GPU: 1, MEM: 100, PCT: 10}),
            True,
            req("w", memory=MemoryRequest(mib=100), init=True),
            id="init-gpumem-wins",
        ),
        pytest.param(ctr(limits={"cpu": 1}), False, None, id="no-gpu"),
        pytest.param(ctr(limits={GPU: 0}), False, None, id="gpu-zero"),
    ],
)
def test_parse_container(
    container: dict[str, Any], init: bool, expected: ContainerGpuRequest | None
) -> None:
    assert parse_container(container, init=init, settings=RequestSettings()) == expected


def test_parse_container_error_names_container() -> None:
    with pytest.raises(RequestError, match=r"container 'x': nvidia\.com/gpucores"):
        parse_container(ctr("x", limits={CORES: -5}), init=False, settings=RequestSettings())


# ---------------------------------------------------------------- quick check


@pytest.mark.parametrize(
    ("manifest", "settings", "expected"),
    [
        pytest.param(pod(ctr(limits={GPU: 1})), RequestSettings(), True, id="limits"),
        pytest.param(pod(ctr(requests={CORES: 1})), RequestSettings(), True, id="requests"),
        pytest.param(
            pod(ctr(), init=(ctr("i", limits={MEM: 1}),)), RequestSettings(), True, id="init"
        ),
        pytest.param(pod(ctr(limits={"cpu": 1})), RequestSettings(), False, id="cpu"),
        pytest.param(pod(ctr(limits={GPU: 1})), CUSTOM_NAMES, False, id="custom-names"),
        pytest.param({"spec": {"containers": "x"}}, RequestSettings(), False, id="malformed"),
        pytest.param(pod(ctr(limits={GPU: 0})), RequestSettings(), True, id="gpu-zero"),
    ],
)
def test_has_gpu_request(
    manifest: dict[str, Any], settings: RequestSettings, expected: bool
) -> None:
    assert has_gpu_request(manifest, settings) is expected


@pytest.mark.parametrize(
    ("manifest", "expected"),
    [
        pytest.param(pod(ctr(limits={GPU: 1})), True, id="count"),
        pytest.param(pod(ctr(requests={CORES: 30})), True, id="cores-alone"),
        pytest.param(pod(ctr(limits={MEM: 0})), True, id="gpumem-0-brings-the-default-count"),
        pytest.param(pod(ctr(limits={"cpu": 1})), False, id="no-gpu"),
        pytest.param(pod(ctr(limits={GPU: 0})), False, id="gpu-zero"),
        pytest.param(pod(ctr(limits={GPU: "0"}, requests={GPU: "0m"})), False, id="gpu-zero-both"),
        pytest.param(
            pod(ctr(limits={GPU: 0}), init=(ctr("i", requests={GPU: "0"}),)),
            False,
            id="gpu-zero-everywhere",
        ),
        pytest.param(
            pod(ctr(limits={GPU: 0}, requests={"cpu": 1}), annotations={"x": 1}),
            False,
            id="gpu-zero-annotations-unread",
        ),
        pytest.param(pod(ctr(limits={GPU: 0}), ctr("b", limits={GPU: 1})), True, id="one-of-two"),
        # rejected by parse_pod: the caller reads it and says why
        pytest.param(pod(ctr(limits={GPU: 0, MEM: 100})), True, id="gpu-zero-with-gpumem"),
        pytest.param(pod(ctr(limits={GPU: 0}, requests={GPU: 1})), True, id="gpu-zero-differs"),
        pytest.param(pod(ctr(limits={GPU: "lots"})), True, id="gpu-unreadable"),
        pytest.param(pod(ctr(limits={PRIO: 0})), True, id="priority-alone"),
    ],
)
def test_asks_for_gpus(manifest: dict[str, Any], expected: bool) -> None:
    assert asks_for_gpus(manifest) is expected


def test_annotation_keys_cover_both_forms() -> None:
    assert ANNOTATIONS.gpu_policy.hami == "hami.io/gpu-scheduler-policy"
    assert ANNOTATIONS.gpu_policy.gpuslice == "gpuslice.io/gpu-scheduler-policy"
    assert ANNOTATIONS.use_gpu_type.lookup_order() == (
        "gpuslice.io/use-gputype",
        "nvidia.com/use-gputype",
    )


# ---------------------------------------------------------------- quantities


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1", Decimal(1)),
        ("10", Decimal(10)),
        ("0", Decimal(0)),
        ("1k", Decimal(1000)),
        ("1Ki", Decimal(1024)),
        ("2Mi", Decimal(2 * 1024**2)),
        ("1Gi", Decimal(1024**3)),
        ("1Ei", Decimal(1024**6)),
        ("3M", Decimal(3_000_000)),
        ("1E", Decimal(10**18)),
        ("1e3", Decimal(1000)),
        ("1E3", Decimal(1000)),
        ("2e-1", Decimal("0.2")),
        ("500m", Decimal("0.5")),
        ("250u", Decimal("0.00025")),
        ("7n", Decimal("0.000000007")),
        ("+5", Decimal(5)),
        ("-1", Decimal(-1)),
        ("1.5", Decimal("1.5")),
        (".5", Decimal("0.5")),
        ("0.5Gi", Decimal(512 * 1024**2)),
        (42, Decimal(42)),
        (-3, Decimal(-3)),
    ],
)
def test_parse_quantity(text: str | int, expected: Decimal) -> None:
    assert parse_quantity(text) == expected


@pytest.mark.parametrize(
    "value",
    [
        "",
        "abc",
        "1.2.3",
        "Ki",
        "1ki",
        "1K",
        "1e",
        "1e1.5",
        " 1",
        "1 ",
        "1\n",
        "--1",
        "\u0661",  # an Arabic-Indic digit
        "1e999999999",
        "1e-999999999",
        "9" * 129,
        "1e31",
        10**31,
        1.0,
        True,
        None,
        [1],
        {"value": 1},
    ],
    ids=repr,
)
def test_parse_quantity_rejects(value: object) -> None:
    started = time.perf_counter()
    with pytest.raises(RequestError):
        parse_quantity(value)
    assert time.perf_counter() - started < 0.1


@pytest.mark.parametrize(
    ("value", "too_large"),
    [
        ("1e31", True),
        (10**31, True),
        ("1e999999999", True),
        ("1e" + "9" * 20, True),
        ("9" * 129, True),
        ("1" + "0" * 200 + "Ei", True),  # the API server's canonical form of a huge one
        ("0" * 129, False),
        ("0." + "0" * 130 + "1", False),
        ("0.00000001e65", True),  # 1e57
        ("0." + "0" * 70 + "1e65", False),  # 1e-6, only its exponent out of range
        ("1e-999999999", False),
        ("0e999999999", False),
        ("-1e31", False),
        (-(10**31), False),
        ("-" + "9" * 129, False),
        ("1x" + "0" * 200, False),
    ],
    ids=lambda v: repr(v)[:20],
)
def test_a_quantity_too_large_to_read_is_told_from_one_unreadable(
    value: object, too_large: bool
) -> None:
    with pytest.raises(RequestError) as caught:
        parse_quantity(value)
    assert isinstance(caught.value, QuantityTooLarge) is too_large


def test_an_init_container_that_restarts_always_is_a_sidecar() -> None:
    pod = {
        "metadata": {"uid": "u1", "name": "p"},
        "spec": {
            "initContainers": [
                {
                    "name": "proxy",
                    "restartPolicy": "Always",
                    "resources": {"limits": {"nvidia.com/gpumem": 1000}},
                },
                {"name": "setup", "resources": {"limits": {"nvidia.com/gpumem": 2000}}},
            ],
            "containers": [{"name": "app", "resources": {"limits": {"nvidia.com/gpumem": 3000}}}],
        },
    }
    parsed = parse_pod(pod)
    assert parsed is not None
    assert [(c.name, c.init, c.sidecar) for c in parsed.containers] == [
        ("proxy", True, True),
        ("setup", True, False),
        ("app", False, False),
    ]
