"""The agent's host directory: container directories, owner records, cleanup and the
installed interposer."""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from gpuslice_deviceplugin.containers import (
    OWNER_FILE,
    REGION_FILE,
    ContainerOwner,
    HostDir,
    InstallError,
    OwnerError,
)

UID = "0b3a9c3e-5d1f-4c7a-9e2b-1f2e3d4c5b6a"
GPU0 = "GPU-facefeed-0000-4000-8000-000000000000"
GPU1 = "GPU-facefeed-0000-4000-8000-000000000001"


def owner(pod_uid: str = UID, container: str = "main", at: float | None = None) -> ContainerOwner:
    return ContainerOwner(
        pod_uid=pod_uid,
        namespace="team",
        pod_name=f"pod-{pod_uid[:8]}",
        container=container,
        devices=(GPU1, GPU0),
        allocated_at=time.time() if at is None else at,
    )


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def host(tmp_path: Path) -> HostDir:
    return HostDir(tmp_path / "host")


@pytest.fixture
def strict_umask() -> Iterator[None]:
    old = os.umask(0o077)
    yield
    os.umask(old)


# ----------------------------------------------------------------------------- layout


def test_layout(host: HostDir) -> None:
    root = host.root
    assert host.lib_path == root / "lib" / "libgpuslice.so"
    assert host.preload_path == root / "ld.so.preload"
    assert host.containers_root == root / "containers"
    assert host.container_dir(UID, "main") == root / "containers" / UID / "main"
    assert REGION_FILE == "region"


@pytest.mark.parametrize(
    "pod_uid", ["", ".", "..", "../etc", "a/b", "a.b", "a b", "x" * 129, "uid\n"]
)
def test_unsafe_pod_uids_are_refused(host: HostDir, pod_uid: str) -> None:
    with pytest.raises(ValueError, match="pod UID"):
        host.container_dir(pod_uid, "main")
    with pytest.raises(ValueError, match="pod UID"):
        host.remove_pod(pod_uid)


@pytest.mark.parametrize(
    "name", ["", ".", "..", "Main", "-a", "a-", "a_b", "a.b", "a/b", "a" * 64, "main\n"]
)
def test_container_names_must_be_rfc1123_labels(host: HostDir, name: str) -> None:
    with pytest.raises(ValueError, match="container name"):
        host.container_dir(UID, name)


def test_the_longest_valid_tokens_are_accepted(host: HostDir) -> None:
    uid, name = "A-9" * 42 + "zz", "a" + "-" * 61 + "0"
    assert len(uid) == 128
    assert len(name) == 63
    assert host.container_dir(uid, name).relative_to(host.containers_root) == Path(uid, name)


# ----------------------------------------------------------------------------- owner records


def test_owner_round_trips_through_json() -> None:
    o = owner(at=1700000000.25)
    back = ContainerOwner.from_json(o.to_json())
    assert back == o
    assert back.devices == (GPU1, GPU0)  # container order kept
    assert ContainerOwner.from_json(o.to_json().encode()) == o


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"pod_uid": "abc"}', "lacks namespace"),
        (
            '{"pod_uid": "abc", "namespace": "n", "pod_name": "p", "container": "c",'
            ' "devices": "GPU-1", "allocated_at": 1}',
            "devices must be a list",
        ),
        (
            '{"pod_uid": "../x", "namespace": "n", "pod_name": "p", "container": "c",'
            ' "devices": [], "allocated_at": 1}',
            "pod UID",
        ),
        (
            '{"pod_uid": "abc", "namespace": "n", "pod_name": "p", "container": "c",'
            ' "devices": [], "allocated_at": "yesterday"}',
            "allocated_at",
        ),
        (
            '{"pod_uid": "abc", "namespace": "n", "pod_name": "p", "container": "c",'
            ' "devices": [1], "allocated_at": 1}',
            "devices",
        ),
    ],
)
def test_a_bad_owner_record_says_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(OwnerError, match=message):
        ContainerOwner.from_json(text)


def test_an_owner_with_an_unsafe_pod_uid_cannot_be_made() -> None:
    with pytest.raises(ValueError, match="pod UID"):
        owner(pod_uid="../../etc")


# ----------------------------------------------------------------------------- preparing


@pytest.mark.usefixtures("strict_umask")
def test_prepare_makes_a_world_writable_directory_whatever_the_umask(host: HostDir) -> None:
    o = owner()
    directory = host.prepare_container(o)
    assert directory == host.container_dir(UID, "main")
    assert mode(directory) == 0o777
    assert mode(directory.parent) == 0o755
    assert mode(host.containers_root) == 0o755
    record = directory / OWNER_FILE
    assert mode(record) == 0o644
    assert ContainerOwner.from_json(record.read_text()) == o
    assert [p.name for p in directory.iterdir()] == [OWNER_FILE]  # no temporary left


def test_preparing_again_replaces_the_owner_record(host: HostDir) -> None:
    first = owner(at=100.0)
    directory = host.prepare_container(first)
    (directory / REGION_FILE).write_bytes(b"kept")
    again = replace(first, allocated_at=200.0)
    assert host.prepare_container(again) == directory
    assert host.containers() == [(again, directory)]
    assert (directory / REGION_FILE).read_bytes() == b"kept"


def test_containers_lists_prepared_directories_and_skips_bad_records(
    host: HostDir, caplog: pytest.LogCaptureFixture
) -> None:
    good = [owner("pod-b", "main"), owner("pod-a", "side"), owner("pod-a", "main")]
    for o in good:
        host.prepare_container(o)
    corrupt = host.prepare_container(owner("pod-c")) / OWNER_FILE
    corrupt.write_text('{"pod_uid": ')
    elsewhere = host.prepare_container(owner("pod-d")) / OWNER_FILE
    elsewhere.write_text(owner("pod-a").to_json())  # names another directory
    (host.containers_root / "pod-e" / "main").mkdir(parents=True)  # no record yet
    (host.containers_root / "not a pod").mkdir()
    with caplog.at_level(logging.WARNING, logger="gpuslice_deviceplugin.containers"):
        found = host.containers()
        again = host.containers()
    assert [(o.pod_uid, o.container) for o, _ in found] == [
        ("pod-a", "main"),
        ("pod-a", "side"),
        ("pod-b", "main"),
    ]
    assert all(d == host.container_dir(o.pod_uid, o.container) for o, d in found)
    assert again == found
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2, warned  # once each, not on every listing
    assert str(corrupt) in warned[0]
    assert "not JSON" in warned[0]
    assert str(elsewhere) in warned[1]
    assert "names pod pod-a" in warned[1]


def test_a_container_cannot_plant_links_or_fifos_as_its_owner_record(
    host: HostDir, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    elsewhere = tmp_path / "forged.json"
    elsewhere.write_text(owner("pod-l").to_json())
    link = host.prepare_container(owner("pod-l")) / OWNER_FILE
    link.unlink()
    link.symlink_to(elsewhere)
    fifo = host.prepare_container(owner("pod-f")) / OWNER_FILE
    fifo.unlink()
    os.mkfifo(fifo)  # reading it would wait for a writer forever
    huge = host.prepare_container(owner("pod-h")) / OWNER_FILE
    huge.write_bytes(b" " * (1 << 20))
    with caplog.at_level(logging.WARNING, logger="gpuslice_deviceplugin.containers"):
        assert host.containers() == []
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert all(str(path) in warned for path in (link, fifo, huge)), warned
    assert "not a regular file" in warned


def test_containers_of_a_missing_root_is_empty(host: HostDir) -> None:
    assert host.containers() == []
    assert host.cleanup(set(), 0) == []


# ----------------------------------------------------------------------------- cleanup


def test_cleanup_removes_only_old_directories_of_dead_pods(host: HostDir) -> None:
    now = 1_000_000.0
    host.prepare_container(owner("live", at=now - 3600))
    host.prepare_container(owner("young", at=now - 30))
    host.prepare_container(owner("old", at=now - 3600))
    host.prepare_container(owner("old", "side", at=now - 3600))
    host.prepare_container(owner("mixed", at=now - 3600))
    host.prepare_container(owner("mixed", "late", at=now - 10))  # its newest counts
    corrupt = host.prepare_container(owner("corrupt"))  # aged by the directory's mtime
    (corrupt / OWNER_FILE).write_text("garbage")
    os.utime(corrupt, (now - 3600, now - 3600))
    bare = host.containers_root / "bare"
    bare.mkdir()
    os.utime(bare, (now - 3600, now - 3600))

    removed = host.cleanup({"live"}, grace_s=600, now=now)

    assert sorted(removed) == ["bare", "corrupt", "old"]
    left = sorted(p.name for p in host.containers_root.iterdir())
    assert left == ["live", "mixed", "young"]
    assert host.cleanup({"live"}, grace_s=600, now=now) == []


def test_cleanup_defaults_to_the_current_time(host: HostDir) -> None:
    host.prepare_container(owner("gone", at=time.time() - 120))
    host.prepare_container(owner("fresh"))
    assert host.cleanup(set(), grace_s=60) == ["gone"]


def test_remove_pod_deletes_its_containers_and_tolerates_absence(host: HostDir) -> None:
    directory = host.prepare_container(owner())
    (directory / REGION_FILE).write_bytes(b"\0" * 64)
    host.remove_pod(UID)
    assert not directory.parent.exists()
    host.remove_pod(UID)
    assert host.containers() == []


# ----------------------------------------------------------------------------- install


@pytest.fixture
def library(tmp_path: Path) -> Path:
    path = tmp_path / "image" / "libgpuslice.so"
    path.parent.mkdir()
    path.write_bytes(b"\x7fELF first build" + bytes(range(256)) * 64)
    path.chmod(0o600)
    return path


@pytest.mark.usefixtures("strict_umask")
def test_install_copies_the_library_and_names_it_for_ld_so(host: HostDir, library: Path) -> None:
    host.install(library, "/usr/local/gpuslice")
    assert host.lib_path.read_bytes() == library.read_bytes()
    assert mode(host.lib_path) == 0o755
    assert mode(host.lib_path.parent) == 0o755
    assert host.preload_path.read_text() == "/usr/local/gpuslice/libgpuslice.so\n"
    assert mode(host.preload_path) == 0o644
    assert sorted(p.name for p in host.lib_path.parent.iterdir()) == ["libgpuslice.so"]


def test_installing_the_same_library_keeps_the_file(host: HostDir, library: Path) -> None:
    host.install(library, "/usr/local/gpuslice")
    before = (host.lib_path.stat().st_ino, host.preload_path.stat().st_ino)
    host.lib_path.chmod(0o700)
    host.install(library, "/usr/local/gpuslice")
    assert (host.lib_path.stat().st_ino, host.preload_path.stat().st_ino) == before
    assert mode(host.lib_path) == 0o755


def test_a_new_library_replaces_the_file_and_old_mappings_keep_theirs(
    host: HostDir, library: Path
) -> None:
    host.install(library, "/usr/local/gpuslice")
    old_content = host.lib_path.read_bytes()
    old_inode = host.lib_path.stat().st_ino
    with host.lib_path.open("rb") as in_use:  # as a running container holds it
        library.write_bytes(b"\x7fELF second build")
        host.install(library, "/opt/gs/")
        assert host.lib_path.stat().st_ino != old_inode
        assert host.lib_path.read_bytes() == b"\x7fELF second build"
        assert in_use.read() == old_content
    assert host.preload_path.read_text() == "/opt/gs/libgpuslice.so\n"
    assert sorted(p.name for p in host.lib_path.parent.iterdir()) == ["libgpuslice.so"]


def test_installing_a_missing_library_names_it(host: HostDir, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "libgpuslice.so"
    with pytest.raises(InstallError, match=str(missing)):
        host.install(missing, "/usr/local/gpuslice")
    assert not host.lib_path.exists()
    assert not host.preload_path.exists()


@pytest.mark.parametrize("lib_dir", ["relative/dir", "/with space", "/a:b"])
def test_the_container_library_directory_must_suit_ld_so_preload(
    host: HostDir, library: Path, lib_dir: str
) -> None:
    with pytest.raises(InstallError, match="absolute path"):
        host.install(library, lib_dir)
