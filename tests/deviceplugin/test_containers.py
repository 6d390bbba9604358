"""The agent's host directory: container directories with their owner records, grants
and regions, cleanup and the installed interposer."""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from gpuslice_common.control import CONTROL_FILE
from gpuslice_common.grant import Grant, GrantDevice
from gpuslice_common.grant import parse as parse_grant
from gpuslice_common.region import REGION_SIZE, Region
from gpuslice_deviceplugin.containers import (
    GRANT_FILE,
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


def grant(o: ContainerOwner, memory_mib: int = 1024, sm: int = 30) -> Grant:
    """The grant the agent would write for ``o``: ``memory_mib`` and ``sm`` on each GPU."""
    return Grant(
        node="node-a",
        pod_uid=o.pod_uid,
        container=o.container,
        policy="force",
        priority=0,
        control_optional=False,
        context_overhead_bytes=64 << 20,
        devices=tuple(
            GrantDevice(uuid=u, memory_bytes=memory_mib << 20, sm_percent=sm) for u in o.devices
        ),
    )


def prepare(host: HostDir, o: ContainerOwner) -> Path:
    return host.prepare_container(o, grant(o))


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def region_devices(path: Path) -> list[tuple[str, int, int]]:
    with Region.open(path) as r:
        return [(d.uuid, d.limit_bytes, d.sm_limit_percent) for d in r.devices()]


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
def test_prepare_lays_out_the_container_with_fixed_modes_whatever_the_umask(
    host: HostDir,
) -> None:
    o = owner()
    directory = host.prepare_container(o, grant(o))
    assert directory == host.container_dir(UID, "main")
    assert mode(host.containers_root) == 0o700  # no other user of the host reaches in
    assert mode(directory.parent) == 0o755
    assert mode(directory) == 0o755  # the container cannot add, swap or link files here
    assert mode(directory / OWNER_FILE) == 0o644
    assert mode(directory / GRANT_FILE) == 0o444
    assert mode(directory / CONTROL_FILE) == 0o444  # the agent's alone
    assert mode(directory / REGION_FILE) == 0o666  # the container may run as any user
    assert ContainerOwner.from_json((directory / OWNER_FILE).read_text()) == o
    assert parse_grant((directory / GRANT_FILE).read_text()) == grant(o)
    # the region is there before any process of the container runs, set up for it
    assert region_devices(directory / REGION_FILE) == [
        (GPU1, 1024 << 20, 30),
        (GPU0, 1024 << 20, 30),
    ]
    assert (directory / REGION_FILE).stat().st_size == REGION_SIZE
    assert (directory / REGION_FILE).stat().st_nlink == 1
    # no temporary left
    assert sorted(p.name for p in directory.iterdir()) == [
        CONTROL_FILE,
        GRANT_FILE,
        OWNER_FILE,
        REGION_FILE,
    ]


def test_a_container_directory_of_the_older_layout_is_closed_again(host: HostDir) -> None:
    o = owner()
    directory = host.container_dir(UID, "main")
    directory.mkdir(parents=True)
    for path in (host.containers_root, directory.parent, directory):
        path.chmod(0o777)
    host.prepare_container(o, grant(o))
    assert (mode(host.containers_root), mode(directory.parent), mode(directory)) == (
        0o700,
        0o755,
        0o755,
    )


def test_a_whole_gpu_is_no_sm_limit_in_the_region(host: HostDir) -> None:
    o = owner()
    directory = host.prepare_container(o, grant(o, memory_mib=512, sm=100))
    assert region_devices(directory / REGION_FILE) == [(GPU1, 512 << 20, 0), (GPU0, 512 << 20, 0)]
    assert parse_grant((directory / GRANT_FILE).read_text()).devices[0].sm_percent == 100


def test_preparing_again_replaces_the_records_and_keeps_a_valid_region(host: HostDir) -> None:
    first = owner(at=100.0)
    directory = host.prepare_container(first, grant(first))
    region = directory / REGION_FILE
    inode = region.stat().st_ino
    with Region.open(region, writable=True) as r:  # as the coordinator marks it
        r.set_flags(0, shared=True, yield_=True)
    again = replace(first, allocated_at=200.0)
    assert host.prepare_container(again, grant(again, memory_mib=2048)) == directory
    assert host.containers() == [(again, directory)]
    assert parse_grant((directory / GRANT_FILE).read_text()) == grant(again, memory_mib=2048)
    assert region.stat().st_ino == inode  # a running container maps it: kept as it is
    with Region.open(region) as r:
        assert (r.devices()[0].shared, r.devices()[0].yield_) == (True, True)
    assert sorted(p.name for p in directory.iterdir()) == [
        CONTROL_FILE,
        GRANT_FILE,
        OWNER_FILE,
        REGION_FILE,
    ]


def _symlink(region: Path, tmp_path: Path) -> Path:
    target = tmp_path / "elsewhere"
    target.write_bytes(region.read_bytes())  # a valid region, even
    region.unlink()
    region.symlink_to(target)
    return target


def _fifo(region: Path, tmp_path: Path) -> None:
    region.unlink()
    os.mkfifo(region)  # opening it to read would wait for a writer forever


def _truncated(region: Path, tmp_path: Path) -> None:
    os.truncate(region, 100)


def _garbage(region: Path, tmp_path: Path) -> None:
    region.write_bytes(b"\x01" * REGION_SIZE)


def _private(region: Path, tmp_path: Path) -> None:
    region.chmod(0o600)  # as the interposer made it in the older layout


def _linked(region: Path, tmp_path: Path) -> Path:
    other = region.parent / "other"
    os.link(region, other)
    return other


def _longer(region: Path, tmp_path: Path) -> None:
    with region.open("ab") as f:
        f.write(b"\0" * 4096)


@pytest.mark.parametrize(
    "spoil",
    [_symlink, _fifo, _truncated, _garbage, _private, _linked, _longer],
    ids=["symlink", "fifo", "truncated", "garbage", "mode-0600", "hard-link", "longer"],
)
def test_preparing_again_replaces_what_the_interposer_would_refuse_at_region(
    host: HostDir, tmp_path: Path, spoil: Callable[[Path, Path], Path | None]
) -> None:
    o = owner()
    directory = host.prepare_container(o, grant(o))
    region = directory / REGION_FILE
    aside = spoil(region, tmp_path)
    kept = aside.read_bytes() if aside is not None else b""
    assert host.prepare_container(o, grant(o)) == directory
    st = os.lstat(region)
    assert stat.S_ISREG(st.st_mode)
    assert (stat.S_IMODE(st.st_mode), st.st_nlink, st.st_size) == (0o666, 1, REGION_SIZE)
    assert region_devices(region) == [(GPU1, 1024 << 20, 30), (GPU0, 1024 << 20, 30)]
    if aside is not None:  # never written through: the link's target is untouched
        assert aside.read_bytes() == kept
        assert not aside.is_symlink()
    left = {p.name for p in directory.iterdir()} - {aside.name if aside else ""}
    assert left == {CONTROL_FILE, GRANT_FILE, OWNER_FILE, REGION_FILE}


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file away takes root")
def test_a_region_of_another_owner_is_replaced(host: HostDir) -> None:
    o = owner()
    region = host.prepare_container(o, grant(o)) / REGION_FILE
    os.chown(region, 4242, 4242)
    host.prepare_container(o, grant(o))
    assert region.stat().st_uid == os.geteuid()


@pytest.mark.parametrize("level", ["pod", "container"])
def test_a_symlinked_directory_is_refused(host: HostDir, tmp_path: Path, level: str) -> None:
    o = owner()
    directory = host.prepare_container(o, grant(o))
    elsewhere = tmp_path / "elsewhere"
    moved = directory.parent if level == "pod" else directory
    moved.rename(elsewhere)
    moved.symlink_to(elsewhere, target_is_directory=True)
    before = sorted((p.name, p.read_bytes()) for p in elsewhere.rglob("*") if p.is_file())
    # O_NOFOLLOW | O_DIRECTORY on a link: ENOTDIR (ELOOP without O_DIRECTORY)
    with pytest.raises(NotADirectoryError), host.open_container_dir(directory):
        pass
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        host.prepare_container(o, grant(o, memory_mib=1))
    after = sorted((p.name, p.read_bytes()) for p in elsewhere.rglob("*") if p.is_file())
    assert after == before  # nothing written through the link


def test_open_container_dir_opens_the_directory_itself(host: HostDir) -> None:
    o = owner()
    directory = host.prepare_container(o, grant(o))
    with host.open_container_dir(directory) as fd:
        assert os.fstat(fd).st_ino == directory.stat().st_ino
        assert sorted(os.listdir(fd)) == [CONTROL_FILE, GRANT_FILE, OWNER_FILE, REGION_FILE]


def test_containers_lists_prepared_directories_and_skips_bad_records(
    host: HostDir, caplog: pytest.LogCaptureFixture
) -> None:
    good = [owner("pod-b", "main"), owner("pod-a", "side"), owner("pod-a", "main")]
    for o in good:
        prepare(host, o)
    corrupt = prepare(host, owner("pod-c")) / OWNER_FILE
    corrupt.write_text('{"pod_uid": ')
    elsewhere = prepare(host, owner("pod-d")) / OWNER_FILE
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
    link = prepare(host, owner("pod-l")) / OWNER_FILE
    link.unlink()
    link.symlink_to(elsewhere)
    fifo = prepare(host, owner("pod-f")) / OWNER_FILE
    fifo.unlink()
    os.mkfifo(fifo)  # reading it would wait for a writer forever
    huge = prepare(host, owner("pod-h")) / OWNER_FILE
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
    prepare(host, owner("live", at=now - 3600))
    prepare(host, owner("young", at=now - 30))
    prepare(host, owner("old", at=now - 3600))
    prepare(host, owner("old", "side", at=now - 3600))
    prepare(host, owner("mixed", at=now - 3600))
    prepare(host, owner("mixed", "late", at=now - 10))  # its newest counts
    corrupt = prepare(host, owner("corrupt"))  # aged by the directory's mtime
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
    prepare(host, owner("gone", at=time.time() - 120))
    prepare(host, owner("fresh"))
    assert host.cleanup(set(), grace_s=60) == ["gone"]


def test_remove_pod_deletes_its_containers_and_tolerates_absence(host: HostDir) -> None:
    directory = prepare(host, owner())
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
