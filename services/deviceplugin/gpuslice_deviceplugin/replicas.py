"""The devices kubelet sees: ``deviceSplitCount`` replicas of every GPU.

Kubelet counts ``nvidia.com/gpu`` by device IDs, so each physical GPU is
advertised as ``split_count`` replicas, ``<uuid>::<n>``. Which GPUs a container
really gets is the scheduler's choice, written in the ledger; the replica IDs
only keep kubelet's books. Kubelet wants IDs of at most 63 characters: a UUID
too long for that is replaced by a digest of it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

from gpuslice_common.models import GpuDevice, VgpuMode
from gpuslice_deviceplugin.api import deviceplugin_pb2 as pb

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
MAX_ID_LENGTH = 63
SEPARATOR = "::"


def _stem(uuid: str, split_count: int) -> str:
    room = MAX_ID_LENGTH - len(SEPARATOR) - len(str(split_count - 1))
    if len(uuid) <= room:
        return uuid
    return "gpu-" + hashlib.sha256(uuid.encode()).hexdigest()[: room - 4]


@dataclass(frozen=True)
class Replicas:
    """The advertised device list and the way back from an ID to its GPU."""

    devices: tuple[GpuDevice, ...]
    split_count: int

    def __post_init__(self) -> None:
        if self.split_count < 1:
            raise ValueError("split count must be at least 1")

    def ids(self, device: GpuDevice) -> list[str]:
        stem = _stem(device.uuid, self.split_count)
        return [f"{stem}{SEPARATOR}{n}" for n in range(self.split_count)]

    @cached_property
    def _uuid_by_stem(self) -> dict[str, str]:
        return {_stem(d.uuid, self.split_count): d.uuid for d in self.devices}

    def uuid_of(self, device_id: str) -> str | None:
        """The GPU behind a replica ID, or None for an ID this list never had."""
        stem, sep, number = device_id.rpartition(SEPARATOR)
        if not sep or not number.isdigit() or int(number) >= self.split_count:
            return None
        return self._uuid_by_stem.get(stem)

    def advertised(self) -> list[pb.Device]:
        """Every replica with its GPU's health and NUMA node."""
        out: list[pb.Device] = []
        for device in self.devices:
            # a card in MIG mode is shared only by the instances made on it (mode mig)
            shared = device.healthy and (not device.mig or device.mode is VgpuMode.MIG)
            health = HEALTHY if shared else UNHEALTHY
            topology = (
                pb.TopologyInfo(nodes=[pb.NUMANode(ID=device.numa)])
                if device.numa is not None
                else None
            )
            out.extend(
                pb.Device(ID=device_id, health=health, topology=topology)
                for device_id in self.ids(device)
            )
        return out

    def preferred(
        self,
        chosen: Sequence[str],
        available: Iterable[str],
        must_include: Iterable[str],
        size: int,
    ) -> list[str]:
        """``size`` IDs from ``available``, one replica of each GPU in ``chosen`` first.

        ``must_include`` always comes first, as kubelet requires. The rest are
        replicas of the chosen GPUs not yet covered, then replicas of other GPUs,
        so a container's replicas stand for distinct GPUs wherever possible.
        """
        picked = list(dict.fromkeys(must_include))
        covered: set[str | None] = {self.uuid_of(i) for i in picked}
        pool = [i for i in dict.fromkeys(available) if i not in picked]
        by_gpu: dict[str | None, list[str]] = {}
        for device_id in pool:
            by_gpu.setdefault(self.uuid_of(device_id), []).append(device_id)
        order: list[str | None] = [u for u in chosen if u not in covered]
        order += [u for u in by_gpu if u not in covered and u not in order]
        for uuid in order:
            if len(picked) >= size:
                break
            if by_gpu.get(uuid):
                picked.append(by_gpu[uuid].pop(0))
                covered.add(uuid)
        leftovers = (i for ids in by_gpu.values() for i in ids)
        while len(picked) < size:
            nxt = next(leftovers, None)
            if nxt is None:
                break
            picked.append(nxt)
        return picked[:size] if len(picked) > size else picked
