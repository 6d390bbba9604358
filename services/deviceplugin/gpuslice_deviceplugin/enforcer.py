"""The node agent's enforcement: what NVML sees on each card, held to the grants.

The interposer inside a container refuses an allocation past the grant and paces
its kernels; it runs in the tenant's own process, so a process that leaves it
out (a private copy of the driver, memory the driver takes outside hooked
calls) escapes it. This layer runs outside every container and reads what the
driver itself reports. Every ``enforce_interval`` it asks NVML, per card, for
the running processes (compute, graphics and MPS clients) with their used
memory and for each process's share of the card's time since the last sample;
it maps each host PID to its pod (the
pod's cgroup, :mod:`gpuslice_deviceplugin.cgroups`) and its container (the
grant directory mounted in its mount namespace), compares with the grant the
agent wrote at Allocate, and acts:

* **memory**: a container whose processes hold more on a card than its grant,
  plus the grant's context overhead for each of its processes there, plus
  ``enforce_memory_margin``, has its largest process on that card SIGKILLed in
  the sample that shows it;
* **compute**: a container whose busy share of a card, averaged over
  ``enforce_window``, passes its grant's share by ``enforce_compute_tolerance``
  points is throttled: its cgroup is frozen (cgroup v2 ``cgroup.freeze``, else the
  v1 freezer) for part of every interval, the part that brings its estimated
  unthrottled rate down to its share (at most ``MAX_FROZEN``), and thawed when it
  is back below. Freezing stops launches, not a kernel already on the card: a
  process whose kernels keep the card ``HOG_PERCENT`` busy while frozen for
  ``enforce_hog_after`` is killed, and so is the busiest process of a container
  that, throttled over ``enforce_hog_after``, was busier than the time it was
  really left thawed (plus the tolerance): shorter kernels with short gaps, or
  launches queued deep while thawed, outlast every freeze without a hog's run;
* **ungranted**: a pod's process on a card its container has no grant for (or
  in no container the agent made a grant directory for) is killed.

Where the node's driver limits device memory per cgroup (layer 1,
:mod:`gpuslice_deviceplugin.driverlimits`), the enforcer also hands each GPU
container's cgroup v2 group and grant to ``driver_limit`` when the container
first shows on a card, and again every ``DRIVER_LIMIT_EVERY_S`` while it runs:
the agent learns a container's group only from its processes, and re-checking
puts back a limit something raised.

A kill goes to the process sampled, checked by its start time through a pidfd,
never to a PID reused since. Each action is logged, counted
(:class:`~gpuslice_deviceplugin.metrics.EnforcerMetrics`) and reported to the
inventory, which records it as an ``io.gpuslice.enforce.*`` event. A process
outside ``kubepods`` is the host's, not a pod's: it is counted and left alone.

What cannot be read is never guessed: a card whose processes or utilisation
NVML cannot give, or a PID whose cgroup cannot be read, is said once (log line,
``gpuslice_enforce_unreadable``), nothing is done to that process, and the card
reports the layer missing (:meth:`Enforcer.card_layers`). Bad bytes anywhere
are a reading failure, never the loop's end. Stopping thaws everything frozen;
an agent killed outright cannot, so the freeze files of the containers it
throttles are kept in ``FROZEN_RECORD`` in its host directory and thawed when
the next one starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import stat
import time
import uuid as uuidlib
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final, Protocol

from gpuslice_common import grant as grant_format
from gpuslice_common.config import DevicePluginSettings
from gpuslice_common.grant import Grant
from gpuslice_common.nodeapi import EnforcedRequest, EnforceKind
from gpuslice_common.region import REGION_SIZE
from gpuslice_deviceplugin.cgroups import (
    CgroupError,
    Freezer,
    PodCgroup,
    ProcessInfo,
    find_cgroup2_root,
    grant_dir_key,
    host_path,
    namespace_root,
    pod_cgroup,
    read_process,
)
from gpuslice_deviceplugin.containers import GRANT_FILE, REGION_FILE, ContainerOwner, HostDir
from gpuslice_deviceplugin.metrics import EnforcerMetrics

__all__ = [
    "HOG_PERCENT",
    "MAX_FROZEN",
    "CardSample",
    "Enforcer",
    "NvmlSampler",
    "ProcessUse",
    "Sampler",
]

log = logging.getLogger(__name__)

HOG_PERCENT: Final = 90.0  # a sample this busy while frozen counts toward a compute kill
MAX_FROZEN: Final = 0.9  # the most of an interval a container is kept frozen
MIN_FROZEN: Final = 0.02  # below this a throttle ends
GRANT_MAX_BYTES: Final = grant_format.MAX_BYTES
GRANTS_EVERY_S: Final = 1.0  # the container directories looked at again
MAP_EVERY_S: Final = 1.0  # a process's pod and container read again
KILL_LABELS: Final[dict[EnforceKind, str]] = {
    "memory-kill": "memory",
    "compute-kill": "compute",
    "ungranted-kill": "ungranted",
}  # gpuslice_enforce_kills_total's kind
SAID_MAX: Final = 10_000  # things logged once, remembered
DRIVER_LIMIT_EVERY_S: Final = 10.0  # a container's driver limit ensured again
FROZEN_RECORD: Final = "enforcer-frozen"  # throttled containers' freeze files, one a line

DriverLimit = Callable[[str, str, int], None]
"""Layer 1 for one container: (card UUID, the container's cgroup v2 path, grant bytes)."""


@dataclass(frozen=True)
class ProcessUse:
    pid: int
    used_bytes: int


@dataclass(frozen=True)
class CardSample:
    """One card as NVML saw it: None where it could not say."""

    uuid: str
    processes: tuple[ProcessUse, ...] | None
    busy: Mapping[int, float] | None  # pid -> percent of the card since the last sample
    # pids NVML lists without their used memory (NVML_VALUE_NOT_AVAILABLE): shown as 0
    unknown_memory: frozenset[int] = frozenset()


class Sampler(Protocol):
    def sample(self) -> list[CardSample]: ...

    def close(self) -> None: ...


class NvmlSampler:
    """The cards' processes and utilisation through NVML (pynvml)."""

    def __init__(self) -> None:
        import pynvml  # type: ignore[import-untyped]

        self._nvml: Any = pynvml
        pynvml.nvmlInit()
        self._seen: dict[str, int] = {}  # card -> newest utilisation timestamp (µs)

    def sample(self) -> list[CardSample]:
        n = self._nvml
        cards = []
        for index in range(int(n.nvmlDeviceGetCount())):
            handle = n.nvmlDeviceGetHandleByIndex(index)
            uuid = str(n.nvmlDeviceGetUUID(handle))
            processes: tuple[ProcessUse, ...] | None
            unknown: set[int] = set()
            try:
                # a process with a graphics context only (a tenant's own Vulkan or
                # OpenGL driver) or an MPS client is not in the compute list
                running = [
                    *n.nvmlDeviceGetComputeRunningProcesses(handle),
                    *n.nvmlDeviceGetGraphicsRunningProcesses(handle),
                    *n.nvmlDeviceGetMPSComputeRunningProcesses(handle),
                ]
            except n.NVMLError:
                processes = None
            else:
                # pynvml gives None for NVML_VALUE_NOT_AVAILABLE: unknown, not 0
                unknown = {int(p.pid) for p in running if p.usedGpuMemory is None}
                used: dict[int, int] = {}  # a process in two lists is one process
                for p in running:
                    used[int(p.pid)] = max(used.get(int(p.pid), 0), int(p.usedGpuMemory or 0))
                processes = tuple(ProcessUse(pid, b) for pid, b in used.items())
            busy: dict[int, float] | None
            try:
                samples = n.nvmlDeviceGetProcessUtilization(handle, self._seen.get(uuid, 0))
            except n.NVMLError_NotFound:
                busy = {}
            except n.NVMLError:
                busy = None
            else:
                sums: dict[int, list[float]] = {}
                for s in samples:
                    sums.setdefault(int(s.pid), []).append(float(s.smUtil))
                    self._seen[uuid] = max(self._seen.get(uuid, 0), int(s.timeStamp))
                busy = {pid: min(100.0, sum(v) / len(v)) for pid, v in sums.items()}
            cards.append(CardSample(uuid, processes, busy, frozenset(unknown)))
        return cards

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._nvml.nvmlShutdown()


@dataclass(frozen=True)
class Granted:
    """A container directory the agent made, with its grant."""

    owner: ContainerOwner
    grant: Grant

    def device(self, card: str) -> grant_format.GrantDevice | None:
        return next((d for d in self.grant.devices if d.uuid == card), None)


@dataclass
class _Compute:
    """A container's use of one card over the window."""

    busy: deque[tuple[float, float]] = field(default_factory=deque)  # (time, percent)
    frozen: deque[tuple[float, float]] = field(default_factory=deque)  # (time, fraction)
    hog_since: float | None = None
    # (time, seconds frozen so far, busy percent) while throttled, over enforce_hog_after
    held: deque[tuple[float, float, float]] = field(default_factory=deque)


@dataclass
class _Throttle:
    target: str  # the freeze file
    pod_uid: str
    container: str
    fraction: float = 0.0
    frozen: bool = False
    frozen_s: float = 0.0  # time spent frozen, up to the last thaw
    frozen_at: float | None = None  # monotonic time of the freeze in force

    def frozen_total(self, now: float) -> float:
        """Seconds this container has really been frozen (writes, not targets)."""
        return self.frozen_s + (now - self.frozen_at if self.frozen_at is not None else 0.0)


@dataclass(frozen=True)
class _Proc:
    info: ProcessInfo
    cgroup: PodCgroup
    granted: Granted | None


class Enforcer:
    """Samples, maps and acts; :meth:`run` every ``enforce_interval`` until cancelled."""

    def __init__(
        self,
        settings: DevicePluginSettings,
        host: HostDir,
        sampler: Sampler | None,
        metrics: EnforcerMetrics,
        driver_limit: DriverLimit | None = None,
    ) -> None:
        self.settings = settings
        self.driver_limit = driver_limit
        self._limited: dict[tuple[str, str], float] = {}  # (card, container cgroup) -> when
        self.host = host
        self.sampler = sampler
        self.metrics = metrics
        self.proc_root = settings.proc_root
        v2 = settings.cgroup_root or find_cgroup2_root()
        self.freezer = Freezer(v2, settings.cgroup_v1_freezer_root)
        self.ns_root = "/"  # where the agent's cgroup namespace lies in the host's tree
        if v2 is not None:
            try:
                self.ns_root = namespace_root(v2, self.proc_root)
            except (CgroupError, ProcessLookupError, OSError) as exc:
                log.warning("own cgroup not found in %s (%s): cgroup paths taken as seen", v2, exc)
        if self.ns_root != "/":
            log.info("cgroup paths seen from a namespace rooted at %s of the host's", self.ns_root)
        self.interval = settings.enforce_interval.total_seconds()
        self.window = settings.enforce_window.total_seconds()
        self.margin = int(settings.enforce_memory_margin)
        self.tolerance = settings.enforce_compute_tolerance
        self.hog_after = settings.enforce_hog_after.total_seconds()
        self._layers: dict[str, tuple[bool, bool]] = {}
        self._said: set[str] = set()  # what was logged once
        self._grants: dict[tuple[int, int], Granted] = {}
        self._grant_stamps: dict[Path, tuple[int, int, int]] = {}
        self._grants_at = -GRANTS_EVERY_S
        self._grants_fresh = False
        self._compute: dict[tuple[str, str, str], _Compute] = {}  # (pod, container, card)
        self._throttles: dict[str, _Throttle] = {}  # container cgroup -> throttle
        self._bound: dict[tuple[str, str], str] = {}  # (pod, container) -> its cgroup
        # container cgroup -> (seconds frozen under its ended throttles, when one ended)
        self._frozen_before: dict[str, tuple[float, float]] = {}
        self._killed: dict[tuple[int, int], float] = {}  # (pid, start) -> when
        self._needed: dict[str, float] = {}
        self._map_cache: dict[int, tuple[float, _Proc | None]] = {}
        self._targets: dict[str, str | None] = {}  # container cgroup -> its freeze file
        self._record = host.root / FROZEN_RECORD
        self._recorded: list[str] = []
        self._thaw_recorded()

    # ------------------------------------------------------------ reporting

    def card_layers(self) -> dict[str, tuple[bool, bool]]:
        """Per card UUID, (memory_ok, compute_ok) at the last sample: whether this
        layer could enforce memory (NVML listed the processes and every pod
        process's cgroup was read) and compute (also their utilisation, and a freezer
        for every throttled container). A card not sampled yet is absent: missing."""
        return dict(self._layers)

    def _once(self, key: str, message: str, *args: object) -> None:
        if len(self._said) >= SAID_MAX:  # keys name PIDs and paths: bounded, said again
            self._said.clear()
        if key not in self._said:
            self._said.add(key)
            log.warning(message, *args)

    # ------------------------------------------------------------ one sample

    def tick(self, now: float | None = None) -> list[EnforcedRequest]:
        """One sample: read, map, kill; the duty cycle for the next interval is
        left in the throttles. What was done, as reports for the inventory."""
        at = time.monotonic() if now is None else now
        started = time.perf_counter()
        actions: list[EnforcedRequest] = []
        if self.sampler is None:
            return actions
        try:
            cards = self.sampler.sample()
        except Exception as exc:  # NVML failing as a whole: every card is missing
            self.metrics.unreadable.labels("processes").inc()
            self._once("nvml", "enforcement: NVML sample failed: %s", exc)
            for known in self._layers:
                self._set_layer(known, False, False)
            return actions
        self._grants_fresh = False
        if at - self._grants_at >= GRANTS_EVERY_S:
            self._refresh_grants(at)
        self._needed = {}  # container cgroup -> largest fraction this sample
        procs: dict[int, _Proc | None] = {}  # None: not a pod's, gone, or unreadable
        unreadable: set[int] = set()
        live: set[str] = set()
        self._bind(cards, at, procs, unreadable)
        for card in cards:
            try:
                actions += self._card(card, at, procs, unreadable, live)
            except Exception:  # a defect must not end enforcement of the other cards
                log.exception("enforcement of card %s failed", card.uuid)
                self._set_layer(card.uuid, False, False)
        self._end_gone_throttles(live, at)
        self._record_frozen()
        for key in [k for k, t in self._killed.items() if at - t > 60]:
            del self._killed[key]
        for held in [k for k, t in self._limited.items() if at - t > 6 * DRIVER_LIMIT_EVERY_S]:
            del self._limited[held]
        for pid in [p for p, (t, _) in self._map_cache.items() if at - t >= MAP_EVERY_S]:
            del self._map_cache[pid]
        self.metrics.throttled.set(sum(1 for t in self._throttles.values() if t.fraction > 0))
        self.metrics.sample_seconds.observe(time.perf_counter() - started)
        return actions

    def _card(
        self,
        card: CardSample,
        at: float,
        procs: dict[int, _Proc | None],
        unreadable: set[int],
        live: set[str],
    ) -> list[EnforcedRequest]:
        actions: list[EnforcedRequest] = []
        memory_ok = card.processes is not None
        compute_ok = memory_ok and card.busy is not None
        if card.processes is None:
            self.metrics.unreadable.labels("processes").inc()
            self._once(f"procs/{card.uuid}", "card %s: NVML cannot list its processes", card.uuid)
            self._set_layer(card.uuid, False, False)
            return actions
        if card.busy is None:
            self.metrics.unreadable.labels("utilization").inc()
            self._once(
                f"util/{card.uuid}", "card %s: NVML cannot give process utilisation", card.uuid
            )
        if card.unknown_memory:  # what they hold cannot be told: not held to a grant
            memory_ok = False
            self.metrics.unreadable.labels("memory").inc()
            self._once(
                f"memory/{card.uuid}",
                "card %s: NVML does not give the used memory of processes %s",
                card.uuid,
                sorted(card.unknown_memory)[:8],
            )
        foreign = 0
        by_container: dict[tuple[str, str], list[tuple[ProcessUse, _Proc]]] = {}
        for use in card.processes:
            if use.pid not in procs:
                procs[use.pid] = self._mapped(use.pid, unreadable, at)
            proc = procs[use.pid]
            if use.pid in unreadable:
                memory_ok = compute_ok = False
                continue
            if proc is None:
                foreign += 1
                continue
            if proc.info.zombie or (use.pid, proc.info.start_ticks) in self._killed:
                continue
            granted = proc.granted
            device = granted.device(card.uuid) if granted is not None else None
            if granted is None or device is None:
                actions += self._kill_ungranted(card.uuid, use, proc, at)
                continue
            key = (granted.owner.pod_uid, granted.owner.container)
            if self._bound.get(key, proc.cgroup.container) != proc.cgroup.container:
                why = f"it shows container {granted.owner.container}'s grant from another cgroup"
                actions += self._kill_ungranted(card.uuid, use, proc, at, why)
                continue
            by_container.setdefault(key, []).append((use, proc))
        self.metrics.foreign.labels(card.uuid).set(foreign)
        for members in by_container.values():
            granted = members[0][1].granted
            assert granted is not None
            device = granted.device(card.uuid)
            assert device is not None
            actions += self._memory(card.uuid, granted, device, members, at)
            self._hold_by_driver(card.uuid, device.memory_bytes, members[0][1], at)
            live.add(members[0][1].cgroup.container)
            if card.busy is not None:
                alone = len(by_container) == 1
                action, ok = self._share(card.uuid, granted, device, members, card.busy, at, alone)
                compute_ok = compute_ok and ok
                actions += action
        self._set_layer(card.uuid, memory_ok, compute_ok)
        return actions

    def _bind(
        self,
        cards: list[CardSample],
        at: float,
        procs: dict[int, _Proc | None],
        unreadable: set[int],
    ) -> None:
        """Each container seen this sample bound to one cgroup: the one it was bound to
        while a process of it still runs there, else the first seen (a restarted
        container comes back in a new one). A container runs in one cgroup; a
        process showing its grant directory from another (a chroot into its root,
        the pod's process namespace shared) would be counted, frozen and held by the
        driver as that container while being elsewhere: it is killed as ungranted."""
        seen: dict[tuple[str, str], list[str]] = {}
        for card in cards:
            for use in card.processes or ():
                if use.pid not in procs:
                    procs[use.pid] = self._mapped(use.pid, unreadable, at)
                proc = procs[use.pid]
                if proc is None or proc.granted is None or proc.info.zombie:
                    continue
                owner = proc.granted.owner
                seen.setdefault((owner.pod_uid, owner.container), []).append(proc.cgroup.container)
        bound = {}
        for key, groups in seen.items():
            before = self._bound.get(key)
            bound[key] = before if before in groups else groups[0]
        self._bound = bound

    def _hold_by_driver(self, card: str, memory_bytes: int, proc: _Proc, at: float) -> None:
        """Layer 1 for the container of ``proc`` on ``card``: its own cgroup v2 group
        (the pod's container group, never a deeper one a process made) held to the
        grant by the driver, ensured again every ``DRIVER_LIMIT_EVERY_S``."""
        if self.driver_limit is None or memory_bytes == 0 or proc.info.v2_path is None:
            return
        key = (card, proc.cgroup.container)
        if at - self._limited.get(key, -DRIVER_LIMIT_EVERY_S) < DRIVER_LIMIT_EVERY_S:
            return
        self._limited[key] = at
        try:
            self.driver_limit(card, proc.cgroup.container, memory_bytes)
        except Exception as exc:  # layer 1 failing leaves layer 2 working
            self._once(f"driver/{card}", "card %s: driver limit not ensured: %s", card, exc)

    def _set_layer(self, card: str, memory_ok: bool, compute_ok: bool) -> None:
        before = self._layers.get(card)
        self._layers[card] = (memory_ok, compute_ok)
        self.metrics.layer.labels(card, "memory").set(int(memory_ok))
        self.metrics.layer.labels(card, "compute").set(int(compute_ok))
        if before is not None and before != (memory_ok, compute_ok) and memory_ok and compute_ok:
            log.info("card %s: enforcement layers readable again", card)

    # ------------------------------------------------------------ mapping

    def _mapped(self, pid: int, unreadable: set[int], at: float) -> _Proc | None:
        """:meth:`_map`, kept for ``MAP_EVERY_S``: a process's pod and container do not
        change while it lives. A kill checks the process's start time again, so a PID
        reused meanwhile is never signalled."""
        cached = self._map_cache.get(pid)
        if cached is not None and at - cached[0] < MAP_EVERY_S:
            return cached[1]
        found = self._map(pid, unreadable)
        if pid not in unreadable:
            self._map_cache[pid] = (at, found)
        return found

    def _map(self, pid: int, unreadable: set[int]) -> _Proc | None:
        """The pod process ``pid`` is, with its grant; None for a host process or one
        gone. Adds ``pid`` to ``unreadable`` when its cgroup cannot be read."""
        try:
            info = read_process(self.proc_root, pid)
            if info.v2_path is not None and self.ns_root != "/":
                info = replace(info, v2_path=host_path(self.ns_root, info.v2_path))
            path = info.v2_path if info.v2_path is not None else info.freezer_path
            cgroup = pod_cgroup(path or "")
            if cgroup is None and info.v2_path is not None and info.freezer_path is not None:
                cgroup = pod_cgroup(info.freezer_path)
            if cgroup is None:
                return None
            key = grant_dir_key(self.proc_root, pid, grant_format.GRANT_DIR)
        except ProcessLookupError:
            return None
        except (CgroupError, OSError, ValueError) as exc:
            unreadable.add(pid)
            self.metrics.unreadable.labels("cgroup").inc()
            self._once(f"cgroup/{pid}", "process %d: not enforced, its cgroup: %s", pid, exc)
            return None
        if key is not None and key not in self._grants and not self._grants_fresh:
            self._refresh_grants(time.monotonic())  # a container newer than the last look
        granted = self._grants.get(key) if key is not None else None
        if granted is not None and granted.owner.pod_uid != cgroup.pod_uid:
            self._once(
                f"foreign-grant/{pid}",
                "process %d of pod %s shows the grant directory of pod %s: taken as ungranted",
                pid,
                cgroup.pod_uid,
                granted.owner.pod_uid,
            )
            granted = None
        return _Proc(info, cgroup, granted)

    def _refresh_grants(self, at: float) -> None:
        """The agent's container directories by (st_dev, st_ino), grants re-read when
        their directory or grant file changed. Done every ``GRANTS_EVERY_S`` and when
        a process shows a directory not known yet."""
        self._grants_at = at
        self._grants_fresh = True
        found: dict[tuple[int, int], Granted] = {}
        stamps: dict[Path, tuple[int, int, int]] = {}
        old = {v.owner.pod_uid + "/" + v.owner.container: (k, v) for k, v in self._grants.items()}
        for owner, directory in self.host.containers():
            try:
                st = os.stat(directory, follow_symlinks=False)
                gst = os.stat(directory / GRANT_FILE, follow_symlinks=False)
            except OSError:
                continue
            self._hold_region(directory)
            key = (st.st_dev, st.st_ino)
            stamp = (gst.st_ino, gst.st_size, gst.st_mtime_ns)
            stamps[directory] = stamp
            previous = old.get(owner.pod_uid + "/" + owner.container)
            if (
                previous is not None
                and previous[0] == key
                and self._grant_stamps.get(directory) == stamp
            ):
                found[key] = previous[1]
                continue
            try:
                with open(directory / GRANT_FILE, "rb") as f:
                    text = f.read(GRANT_MAX_BYTES + 1).decode()
                grant = grant_format.parse(text)
            except (OSError, UnicodeDecodeError, grant_format.GrantError) as exc:
                self.metrics.unreadable.labels("grant").inc()
                self._once(f"grant/{directory}/{stamp}", "grant in %s not read: %s", directory, exc)
                continue
            found[key] = Granted(owner, grant)
        self._grants = found
        self._grant_stamps = stamps

    def _hold_region(self, directory: Path) -> None:
        """Cut a container's region back to its size. It is the one file a container
        may write, and it lies on the node's disk: written past its end it would fill
        that disk. Every process maps only the region's size, so what lies beyond is
        nobody's."""
        try:
            fd = os.open(
                directory / REGION_FILE, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            )
        except OSError:
            return
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size <= REGION_SIZE:
                return
            os.ftruncate(fd, REGION_SIZE)
        except OSError as exc:
            self._once(f"region/{directory}", "region in %s not cut back: %s", directory, exc)
            return
        finally:
            os.close(fd)
        self.metrics.regions_truncated.inc()
        self._once(
            f"region-cut/{directory}",
            "region in %s written to %d bytes, past its %d: cut back",
            directory,
            st.st_size,
            REGION_SIZE,
        )

    # ------------------------------------------------------------ actions

    def _kill(self, proc: _Proc, at: float) -> bool:
        """SIGKILL the very process sampled (pidfd, start time checked again)."""
        pid = proc.info.pid
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return False
        try:
            again = read_process(self.proc_root, pid)
            if again.start_ticks != proc.info.start_ticks:
                return False
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except (ProcessLookupError, CgroupError):
            return False
        finally:
            os.close(fd)
        self._killed[(pid, proc.info.start_ticks)] = at
        # a frozen process dies only once thawed
        throttle = self._throttles.get(proc.cgroup.container)
        if throttle is not None and throttle.frozen:
            self._freeze(throttle, False)
        return True

    def _acted(
        self, kind: EnforceKind, pod_uid: str, container: str | None, reason: str, **figures: Any
    ) -> EnforcedRequest:
        """What was done, logged and counted; the report for the inventory."""
        if container:
            log.warning("pod %s container %s: %s", pod_uid, container, reason)
        else:
            log.warning("pod %s: %s", pod_uid, reason)
        if kind == "throttle":
            self.metrics.throttles.inc()
        else:
            self.metrics.kills.labels(KILL_LABELS[kind]).inc()
        return EnforcedRequest(
            request_id=uuidlib.uuid4().hex,
            kind=kind,
            pod_uid=pod_uid,
            container=container,
            reason=reason,
            **figures,
        )

    def _kill_ungranted(
        self, card: str, use: ProcessUse, proc: _Proc, at: float, why: str | None = None
    ) -> list[EnforcedRequest]:
        if not self._kill(proc, at):
            return []
        container = proc.granted.owner.container if proc.granted else None
        if why is None:
            why = (
                "its container has no grant on this card"
                if container
                else "in no container gpuslice granted"
            )
        reason = f"killed process {use.pid} on {card}: {why}"
        return [
            self._acted(
                "ungranted-kill",
                proc.cgroup.pod_uid,
                container,
                reason,
                card=card,
                pid=use.pid,
                used_bytes=use.used_bytes,
            )
        ]

    def _memory(
        self,
        card: str,
        granted: Granted,
        device: grant_format.GrantDevice,
        members: list[tuple[ProcessUse, _Proc]],
        at: float,
    ) -> list[EnforcedRequest]:
        used = sum(u.used_bytes for u, _ in members)
        allowed = (
            device.memory_bytes + granted.grant.context_overhead_bytes * len(members) + self.margin
        )
        # a grant of 0 bytes is none at all, as the interposer reads it: never "no limit"
        if used <= allowed:
            return []
        use, proc = max(members, key=lambda m: m[0].used_bytes)
        if not self._kill(proc, at):
            return []
        reason = (
            f"killed process {use.pid} on {card}: the container held {used} bytes, "
            f"{allowed} allowed (grant {device.memory_bytes} + context allowance + margin)"
        )
        return [
            self._acted(
                "memory-kill",
                granted.owner.pod_uid,
                granted.owner.container,
                reason,
                card=card,
                pid=use.pid,
                used_bytes=used,
                allowed_bytes=allowed,
            )
        ]

    def _share(
        self,
        card: str,
        granted: Granted,
        device: grant_format.GrantDevice,
        members: list[tuple[ProcessUse, _Proc]],
        busy: Mapping[int, float],
        at: float,
        alone: bool,
    ) -> tuple[list[EnforcedRequest], bool]:
        """Throttle or kill for the compute share; (reports, whether a freezer exists).
        The grant's policy says when the share holds, as the interposer reads it:
        ``force`` always, ``default`` while another container runs on the card (the
        interposer lets one alone on its card run free), ``disable`` never."""
        share = device.sm_percent
        cgroup = members[0][1].cgroup
        key = (granted.owner.pod_uid, granted.owner.container, card)
        state = self._compute.setdefault(key, _Compute())
        now_busy = min(100.0, sum(busy.get(u.pid, 0.0) for u, _ in members))
        throttle = self._throttles.get(cgroup.container)
        state.busy.append((at, now_busy))
        state.frozen.append((at, throttle.fraction if throttle else 0.0))
        while state.busy and at - state.busy[0][0] > self.window:
            state.busy.popleft()
            state.frozen.popleft()
        policy = granted.grant.policy
        if (
            share <= 0
            or share >= 100  # no compute limit
            or policy == "disable"
            or (policy == "default" and alone)
        ):
            throttle = self._throttles.get(cgroup.container)
            if throttle is not None and self._needed.get(cgroup.container, 0.0) == 0.0:
                throttle.fraction = 0.0  # no card needs it frozen (so far): thawed
            self._needed.setdefault(cgroup.container, 0.0)
            state.hog_since = None
            state.held.clear()
            return [], True
        if cgroup.container not in self._targets:
            self._targets[cgroup.container] = self.freezer.target(members[0][1].info, cgroup)
        target = self._targets[cgroup.container]
        if target is None:
            self.metrics.unreadable.labels("freeze").inc()
            self._once(f"freeze/{cgroup.container}", "no freezer for cgroup %s", cgroup.container)
            return [], False
        full = at - state.busy[0][0] >= self.window / 2
        average = sum(b for _, b in state.busy) / len(state.busy)
        frozen = sum(f for _, f in state.frozen) / len(state.frozen)
        actions: list[EnforcedRequest] = []
        throttling = throttle is not None and throttle.fraction > 0
        if throttling or (full and average > share + self.tolerance):
            rate = average / max(1.0 - frozen, 1.0 - MAX_FROZEN)  # what it would run unfrozen
            fraction = min(MAX_FROZEN, max(0.0, 1.0 - share / rate)) if rate > 0 else 0.0
            if fraction < MIN_FROZEN:
                fraction = 0.0
            if throttle is None:
                throttle = _Throttle(target, granted.owner.pod_uid, granted.owner.container)
                self._throttles[cgroup.container] = throttle
            # back on the card within the window after a moment off it: the same
            # throttle, not a new one to report
            if not throttling and fraction > 0 and cgroup.container not in self._frozen_before:
                reason = (
                    f"throttled on {card}: {average:.0f}% of the card over "
                    f"{self.window:g} s, share {share}%; frozen {fraction:.0%} of each interval"
                )
                actions.append(
                    self._acted(
                        "throttle",
                        granted.owner.pod_uid,
                        granted.owner.container,
                        reason,
                        card=card,
                        busy_percent=round(average, 1),
                        share_percent=share,
                        frozen_percent=round(fraction * 100, 1),
                    )
                )
            # a container on several cards is frozen for the largest need
            fraction = max(fraction, self._needed.get(cgroup.container, 0.0))
            self._needed[cgroup.container] = fraction
            throttle.fraction = fraction
        # a kernel holding the card while its process is frozen
        throttle = self._throttles.get(cgroup.container)
        if throttle is not None and throttle.fraction > 0 and now_busy >= HOG_PERCENT:
            state.hog_since = at if state.hog_since is None else state.hog_since
            if at - state.hog_since >= self.hog_after:
                use, proc = max(members, key=lambda m: busy.get(m[0].pid, 0.0))
                state.hog_since = None
                if self._kill(proc, at):
                    reason = (
                        f"killed process {use.pid} on {card}: the card {now_busy:.0f}% busy "
                        f"for {self.hog_after:g} s while throttled, share {share}%"
                    )
                    actions.append(
                        self._acted(
                            "compute-kill",
                            granted.owner.pod_uid,
                            granted.owner.container,
                            reason,
                            card=card,
                            pid=use.pid,
                            busy_percent=round(now_busy, 1),
                            share_percent=share,
                            frozen_percent=round(throttle.fraction * 100, 1),
                        )
                    )
        else:
            state.hog_since = None
        actions += self._unheld(card, granted, members, busy, state, now_busy, share, at)
        return actions, True

    def _unheld(
        self,
        card: str,
        granted: Granted,
        members: list[tuple[ProcessUse, _Proc]],
        busy: Mapping[int, float],
        state: _Compute,
        now_busy: float,
        share: int,
        at: float,
    ) -> list[EnforcedRequest]:
        """Kill a throttled container whose work freezing does not stop: over the last
        ``enforce_hog_after``, busier than the part of the time it was really left
        thawed (and than its share) by more than the tolerance. Kernels shorter than
        ``enforce_hog_after`` with short gaps (or launches queued deep while thawed)
        never make a run of ``HOG_PERCENT`` samples, yet hold the card far past the
        share; work that stops when frozen cannot be busier than the thawed time."""
        throttle = self._throttles.get(members[0][1].cgroup.container)
        if throttle is None or throttle.fraction <= 0:
            state.held.clear()
            return []
        before = self._frozen_before.get(members[0][1].cgroup.container, (0.0, at))[0]
        state.held.append((at, before + throttle.frozen_total(time.monotonic()), now_busy))
        while at - state.held[0][0] > self.hog_after:
            state.held.popleft()
        first, last = state.held[0], state.held[-1]
        span = last[0] - first[0]
        if span < self.hog_after * 0.9:
            return []
        thawed = 100.0 * (1.0 - min(1.0, (last[1] - first[1]) / span))
        average = sum(b for _, _, b in list(state.held)[1:]) / (len(state.held) - 1)
        if average <= max(thawed, share) + self.tolerance:
            return []
        alive = [m for m in members if (m[0].pid, m[1].info.start_ticks) not in self._killed]
        if not alive:  # killed as a hog in this very sample
            return []
        use, proc = max(alive, key=lambda m: busy.get(m[0].pid, 0.0))
        state.held.clear()
        if not self._kill(proc, at):
            return []
        reason = (
            f"killed process {use.pid} on {card}: the card {average:.0f}% busy over "
            f"{self.hog_after:g} s while left thawed {thawed:.0f}% of the time, share {share}%: "
            "freezing does not hold its work"
        )
        return [
            self._acted(
                "compute-kill",
                granted.owner.pod_uid,
                granted.owner.container,
                reason,
                card=card,
                pid=use.pid,
                busy_percent=round(min(100.0, average), 1),
                share_percent=share,
                frozen_percent=round(100.0 - thawed, 1),
            )
        ]

    # ------------------------------------------------------------ duty cycle

    def _freeze(self, throttle: _Throttle, frozen: bool) -> None:
        try:
            Freezer.set(throttle.target, frozen)
        except OSError as exc:
            if frozen:
                self.metrics.unreadable.labels("freeze").inc()
                self._once(
                    f"freeze-write/{throttle.target}", "cannot freeze %s: %s", throttle.target, exc
                )
            return
        throttle.frozen = frozen
        now = time.monotonic()
        if frozen and throttle.frozen_at is None:
            throttle.frozen_at = now
        elif not frozen and throttle.frozen_at is not None:
            throttle.frozen_s += now - throttle.frozen_at
            throttle.frozen_at = None

    def _end_gone_throttles(self, live: set[str], at: float) -> None:
        """Thaw and forget containers that ran nothing on any card this sample."""
        for container in [c for c in self._targets if c not in live]:
            del self._targets[container]
        for container in [c for c in self._throttles if c not in live]:
            throttle = self._throttles.pop(container)
            if throttle.frozen:
                self._freeze(throttle, False)
            # kept for its next throttle: a moment off the card between two processes
            # must not reset how long the container was really frozen
            carried = self._frozen_before.get(container, (0.0, at))[0]
            frozen = carried + throttle.frozen_total(time.monotonic())
            self._frozen_before[container] = (frozen, at)
        for container in [c for c, (_, t) in self._frozen_before.items() if at - t > self.window]:
            if container not in self._throttles:
                del self._frozen_before[container]
        stale = [
            k for k, s in self._compute.items() if not s.busy or s.busy[-1][0] < at - self.window
        ]
        for key in stale:
            del self._compute[key]

    def thaw_all(self) -> None:
        """Thaw every container this enforcer froze (on stop)."""
        for throttle in self._throttles.values():
            if throttle.frozen:
                self._freeze(throttle, False)
        self._throttles.clear()
        self._record_frozen()

    def _record_frozen(self) -> None:
        """Write down the freeze files of the throttled containers (when they change),
        before the duty cycle first freezes one."""
        targets = sorted({t.target for t in self._throttles.values()})
        if targets == self._recorded:
            return
        try:
            temporary = self._record.with_name(FROZEN_RECORD + ".new")
            temporary.write_text("".join(f"{t}\n" for t in targets))
            temporary.replace(self._record)
        except OSError as exc:
            self._once("record", "cannot record frozen containers in %s: %s", self._record, exc)
            return
        self._recorded = targets

    def _thaw_recorded(self) -> None:
        """Thaw what an agent before this one may have left frozen: the freeze files it
        recorded, each checked to be one under this node's freezer roots."""
        try:
            lines = self._record.read_text().splitlines()
        except FileNotFoundError:
            return
        except (OSError, UnicodeDecodeError) as exc:
            self._once("record", "cannot read frozen containers from %s: %s", self._record, exc)
            return
        roots = [r for r in (self.freezer.v2_root, self.freezer.v1_root) if r]
        for line in lines:
            if (
                ".." in line.split("/")
                or not line.endswith(("/cgroup.freeze", "/freezer.state"))
                or not any(line.startswith(r.rstrip("/") + "/") for r in roots)
            ):
                self._once(f"record/{line}", "not a freeze file, not thawed: %r", line[:300])
                continue
            try:
                Freezer.set(line, False)
            except OSError:
                continue  # the container is gone
            log.info("thawed %s, throttled by the agent before this one", line)
        with contextlib.suppress(OSError):
            self._record.unlink()

    async def cycle(self) -> None:
        """Freeze the throttled containers for their part of one interval."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        active = sorted(
            (t for t in self._throttles.values() if t.fraction > 0), key=lambda t: t.fraction
        )
        for throttle in active:
            self._freeze(throttle, True)
        for throttle in active:
            await asyncio.sleep(max(0.0, start + throttle.fraction * self.interval - loop.time()))
            self._freeze(throttle, False)
        for throttle in self._throttles.values():
            if throttle.fraction == 0 and throttle.frozen:
                self._freeze(throttle, False)

    async def run(self, send: Send | None = None) -> None:
        """Sample every interval, acting and throttling, until cancelled; thaws all at
        the end. Each action is handed to ``send`` (the inventory) in a task of its
        own: a slow inventory never holds up the next sample."""
        loop = asyncio.get_running_loop()
        sending: set[asyncio.Task[None]] = set()
        try:
            while True:
                start = loop.time()
                try:
                    actions = await asyncio.to_thread(self.tick)
                except Exception:  # never the loop's end
                    log.exception("enforcement sample failed")
                    actions = []
                for action in actions:
                    if send is None:
                        break
                    task = asyncio.create_task(_send(send, action))
                    sending.add(task)
                    task.add_done_callback(sending.discard)
                await self.cycle()
                await asyncio.sleep(max(0.0, start + self.interval - loop.time()))
        finally:
            self.thaw_all()

    def close(self) -> None:
        self.thaw_all()
        if self.sampler is not None:
            self.sampler.close()


Send = Callable[[EnforcedRequest], Awaitable[None]]


async def _send(send: Send, action: EnforcedRequest) -> None:
    try:
        await send(action)
    except Exception as exc:
        log.warning(
            "%s of pod %s not reported to the inventory: %s", action.kind, action.pod_uid, exc
        )


def open_sampler(backend_name: str) -> Sampler | None:
    """NVML's sampler on a node whose GPUs come from NVML; None otherwise (or when
    NVML will not start: every card then reports the layer missing)."""
    if backend_name != "nvml":
        return None
    try:
        return NvmlSampler()
    except Exception as exc:
        log.warning("enforcement off: NVML did not start: %s", exc)
        return None
