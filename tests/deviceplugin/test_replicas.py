"""Replica IDs: what kubelet counts, and the way back to the GPU."""

from __future__ import annotations

from typing import Any

from gpuslice_common.models import GpuDevice
from gpuslice_deviceplugin.replicas import MAX_ID_LENGTH, Replicas


def gpu(uuid: str, index: int, **kw: Any) -> GpuDevice:
    return GpuDevice(uuid=uuid, index=index, model="m", memory_mib=1024, **kw)


def test_ids_round_trip_and_unknown_ids_are_none() -> None:
    r = Replicas((gpu("GPU-a", 0), gpu("GPU-b", 1)), 3)
    assert r.ids(r.devices[1]) == ["GPU-b::0", "GPU-b::1", "GPU-b::2"]
    assert r.uuid_of("GPU-b::2") == "GPU-b"
    for bad in ("GPU-b::3", "GPU-c::0", "GPU-b", "GPU-b::x", "", "::0"):
        assert r.uuid_of(bad) is None


def test_long_uuids_become_digests_within_kubelet_s_limit() -> None:
    long_uuid = "MIG-" + "f" * 100
    r = Replicas((gpu(long_uuid, 0), gpu("GPU-" + "e" * 100, 1)), 1024)
    ids = r.ids(r.devices[0])
    assert len(ids) == 1024
    assert all(len(i) <= MAX_ID_LENGTH for i in ids)
    assert r.uuid_of(ids[-1]) == long_uuid
    assert not set(ids) & set(r.ids(r.devices[1]))


def test_advertised_carries_health_numa_and_mig() -> None:
    r = Replicas(
        (gpu("GPU-a", 0, numa=1), gpu("GPU-b", 1, healthy=False), gpu("GPU-c", 2, mig=True)), 2
    )
    by_gpu = {d.ID.split("::")[0]: d for d in r.advertised()}
    assert by_gpu["GPU-a"].health == "Healthy"
    assert [n.ID for n in by_gpu["GPU-a"].topology.nodes] == [1]
    assert not by_gpu["GPU-b"].HasField("topology")
    assert by_gpu["GPU-b"].health == by_gpu["GPU-c"].health == "Unhealthy"


def test_preferred_takes_one_replica_of_each_chosen_gpu() -> None:
    r = Replicas((gpu("GPU-a", 0), gpu("GPU-b", 1), gpu("GPU-c", 2)), 4)
    available = [i for d in r.devices for i in r.ids(d)]
    assert r.preferred(["GPU-c", "GPU-a"], available, [], 2) == ["GPU-c::0", "GPU-a::0"]
    # nothing chosen (no pending pod): still distinct GPUs first
    assert r.preferred([], available, [], 3) == ["GPU-a::0", "GPU-b::0", "GPU-c::0"]
    # more than there are GPUs: replicas of the same GPUs fill up
    assert len(set(r.preferred([], available, [], 5))) == 5
    # must-include comes first and counts for its GPU
    assert r.preferred(["GPU-a", "GPU-b"], available, ["GPU-a::3"], 2) == ["GPU-a::3", "GPU-b::0"]
    # only what is available
    assert r.preferred(["GPU-a"], ["GPU-b::1"], [], 1) == ["GPU-b::1"]
