"""Reading a process's pod from its cgroup path, as kubelet and the runtimes name them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuslice_deviceplugin.cgroups import (
    CgroupError,
    PodCgroup,
    host_path,
    pod_cgroup,
    read_process,
)

UID = "0f6c2a8e-55d3-4a4f-9a57-6f1b2c3d4e5f"
SYSTEMD_UID = UID.replace("-", "_")


@pytest.mark.parametrize(
    ("path", "container"),
    [
        (  # systemd driver, burstable, containerd
            f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD_UID}.slice"
            "/cri-containerd-abc.scope",
            f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD_UID}.slice"
            "/cri-containerd-abc.scope",
        ),
        (  # guaranteed: no QoS level; CRI-O
            f"/kubepods.slice/kubepods-pod{SYSTEMD_UID}.slice/crio-abc.scope",
            f"/kubepods.slice/kubepods-pod{SYSTEMD_UID}.slice/crio-abc.scope",
        ),
        (  # cgroupfs driver, with a group the container made below its own
            f"/kubepods/besteffort/pod{UID}/abc/worker",
            f"/kubepods/besteffort/pod{UID}/abc",
        ),
        (  # below a parent of its own (as the tests lay it out)
            f"/test/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD_UID}"
            ".slice/docker-abc.scope",
            f"/test/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD_UID}"
            ".slice/docker-abc.scope",
        ),
    ],
)
def test_a_pod_container_is_found_as_kubelet_names_it(path: str, container: str) -> None:
    assert pod_cgroup(path) == PodCgroup(UID, container)


def test_a_container_cannot_pose_as_another_pod_from_groups_below_its_own() -> None:
    other = "ffffffff-0000-0000-0000-000000000000"
    path = f"/kubepods/burstable/pod{UID}/abc/kubepods/burstable/pod{other}/x"
    assert pod_cgroup(path) == PodCgroup(UID, f"/kubepods/burstable/pod{UID}/abc")


@pytest.mark.parametrize("path", ["/", "/system.slice/containerd.service", "/user.slice/x"])
def test_a_process_outside_kubepods_is_no_pod_s(path: str) -> None:
    assert pod_cgroup(path) is None


@pytest.mark.parametrize(
    "path",
    [
        "/kubepods.slice/kubepods-burstable.slice",  # a pod-less process in a QoS group
        f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD_UID}.slice",
        "/kubepods/burstable/not-a-pod/abc",
        f"/../../kubepods-burstable-pod{SYSTEMD_UID}.slice/cri-containerd-abc.scope",
    ],
)
def test_a_kubepods_path_that_names_no_container_is_an_error(path: str) -> None:
    with pytest.raises(CgroupError):
        pod_cgroup(path)


def test_a_path_seen_from_a_private_cgroup_namespace_is_read_from_the_host_s() -> None:
    root = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podAAA.slice/x.scope"
    seen = f"/../../kubepods-burstable-pod{SYSTEMD_UID}.slice/cri-containerd-abc.scope"
    found = pod_cgroup(host_path(root, seen))
    assert found is not None
    assert found.pod_uid == UID
    assert host_path("/", "/a/b") == "/a/b"


def test_bad_bytes_in_proc_files_are_an_error_not_a_crash(tmp_path: Path) -> None:
    (tmp_path / "7").mkdir()
    cases = [
        (b"7 (x) S 1", b"0::/\n"),  # too few fields
        (b"7 (a) b) S" + b" 1" * 30, b"0::/\xff\n"),  # not UTF-8
        (b"7 (x) S" + b" 1" * 30, b"garbage\n"),
        (b"7 (x) S" + b" 1" * 30, b"3:cpu:/\n"),  # neither v2 nor freezer
    ]
    for stat, cgroup in cases:
        (tmp_path / "7" / "stat").write_bytes(stat)
        (tmp_path / "7" / "cgroup").write_bytes(cgroup)
        with pytest.raises(CgroupError):
            read_process(str(tmp_path), 7)
    with pytest.raises(ProcessLookupError):
        read_process(str(tmp_path), 8)


def test_this_process_reads_as_itself() -> None:
    me = read_process("/proc", os.getpid())
    assert me.pid == os.getpid()
    assert me.start_ticks > 0
    assert not me.zombie
