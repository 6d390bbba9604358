"""The driver's kube-scheduler and kubelet arithmetic for device-plugin
resources: what a pod needs of a node, and one container's Allocate responses
from several plugins merged as kubelet merges them."""

from __future__ import annotations

from gpuslice_cli.dev.driver import ContainerRun, PodOutcome, merge_responses, pod_needs
from gpuslice_cli.dev.up import gpus_of
from gpuslice_deviceplugin.api import deviceplugin_pb2 as pb


def container(limits: dict[str, object], requests: dict[str, object] | None = None) -> object:
    return {"name": "c", "resources": {"limits": limits, "requests": requests or {}}}


def test_a_pod_needs_its_app_containers_sum_or_its_largest_init_container() -> None:
    pod = {
        "spec": {
            "initContainers": [container({"nvidia.com/mig-3g.20gb": 3})],
            "containers": [
                container({"nvidia.com/mig-3g.20gb": 1, "example.com/fpga": 1}),
                container({"nvidia.com/mig-3g.20gb": 1}, {"example.com/fpga": "2"}),
            ],
        }
    }
    assert pod_needs(pod) == {"nvidia.com/mig-3g.20gb": 3, "example.com/fpga": 3}


def test_the_extenders_resources_and_the_core_ones_are_not_counted() -> None:
    pod = {
        "spec": {
            "containers": [
                container(
                    {
                        "nvidia.com/gpu": 2,
                        "nvidia.com/gpumem": 8000,
                        "nvidia.com/gpucores": 30,
                        "nvidia.com/gpumem-percentage": 50,
                        "nvidia.com/priority": 1,
                        "cpu": "2",
                        "memory": "1Gi",
                        "hugepages-2Mi": "1Gi",
                        "example.kubernetes.io/thing": 1,
                    }
                )
            ]
        }
    }
    assert pod_needs(pod) == {}


def test_counts_that_are_not_whole_numbers_in_bounds_count_as_none() -> None:
    pod = {
        "spec": {
            "containers": [
                container({"a.io/x": "1.5", "a.io/y": -1, "a.io/z": 10**9, "a.io/w": "2"})
            ]
        }
    }
    assert pod_needs(pod) == {"a.io/w": 2}


def test_responses_merge_as_kubelet_merges_them() -> None:
    gpu = pb.ContainerAllocateResponse(
        envs={"NVIDIA_VISIBLE_DEVICES": "GPU-a", "A": "1"},
        mounts=[pb.Mount(container_path="/a", host_path="/h/a")],
        annotations={"x": "1"},
    )
    mig = pb.ContainerAllocateResponse(
        envs={"NVIDIA_VISIBLE_DEVICES": "MIG-b"},
        devices=[pb.DeviceSpec(container_path="/dev/x", host_path="/dev/x", permissions="rw")],
    )
    merged = merge_responses([gpu, mig])
    assert dict(merged.envs) == {"NVIDIA_VISIBLE_DEVICES": "MIG-b", "A": "1"}
    assert [m.container_path for m in merged.mounts] == ["/a"]
    assert [d.container_path for d in merged.devices] == ["/dev/x"]
    assert dict(merged.annotations) == {"x": "1"}


def test_the_gpus_column_names_static_mig_devices_with_their_profile() -> None:
    run = ContainerRun(
        "main",
        extended={
            "nvidia.com/mig-3g.20gb": ("MIG-00000000-0000-0000-0000-0000deadbeef",),
            "example.com/fpga": ("fpga-0000000012345678",),
        },
    )
    pod = PodOutcome("p", "default", "uid", "Succeeded", containers=[run])
    assert gpus_of(pod) == {"deadbeef/3g.20gb", "12345678"}
