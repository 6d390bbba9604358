"""The extender's verbs, independent of HTTP: filter, prioritize, bind, preempt.

Filter and prioritize only read (the scheduler's copy of the ledger). Bind is
the one verb with effects, in this order:

1. read the pod from the API server and choose its cards on the node;
2. reserve them in the ledger (atomic; a lost race is an error kube-scheduler
   retries) and publish ``alloc.reserved``;
3. write the placement annotation on the pod (the durable record);
4. mark the reservation bound, then create the Binding; publish ``alloc.bound``.

If anything after the reservation fails, the reservation is released and
``alloc.failed`` is published: a failed bind leaves nothing behind. A bind for a
pod already bound to that node with its reservation in place succeeds again.

A node whose part of the ledger is being rebuilt (Redis lost its data, or the
node is new) fails filter with ``NodeLedgerRebuilding``, and a bind there is an
error naming the node, which kube-scheduler retries: nothing is reserved there
before the placements its pods hold are back.

Where the view follows node CPU and memory (``node_resources``), a pod's own
CPU and memory request is part of its demand, and a pod this extender binds
counts on its node at once (:meth:`NodeResources.assume`), taken back if the
bind fails.

A pod without GPUs passes filter on every node (kube-scheduler has checked its
CPU and memory) and scores 0 everywhere, unless ``score_cpu_pods`` is on and
node CPU and memory are known: then prioritize scores it with the engine as
the trace replay does (FGD: where it strands the fewest GPUs). Its bind only
creates the Binding, counting its CPU and memory on the node at once.

With the in-memory API (``kube_api=local``) a filter call teaches the API its
pod and, when it carries full Node objects, those nodes.

A pod the webhook translated in DRA mode (its claim ``gpuslice`` beside the
HAMi resources it keeps) is placed on a node by this extender and given its
cards by kube-scheduler's DRA allocator there, which the inventory checks when
kubelet prepares the claim:

* filter passes every DRA node (kube-scheduler's DynamicResources plugin
  decides whether the claim's devices fit: the ledger lags allocations not yet
  prepared) and fails the others (``NodeServesDevicePlugin``);
* prioritize scores the DRA nodes as a device-plugin pod of the same request,
  by the engine over the ledger (0 where it does not fit there);
* bind only creates the Binding: nothing is reserved and no placement is
  written (the inventory records the claim when kubelet prepares it, and
  kubelet names the claim, so no bind turns are needed).

Device-plugin GPU pods never go to DRA nodes, and DRA pods never to others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from gpuslice_common.config import SchedulerSettings
from gpuslice_common.dra import has_pod_claim
from gpuslice_common.events import AllocationEvent, EventType, make_event
from gpuslice_common.kube import KubeApi, KubeError, LocalKubeApi
from gpuslice_common.ledger import (
    AlreadyReserved,
    Ledger,
    LedgerError,
    LedgerRebuilding,
    NodeBusy,
    ReservationConflict,
)
from gpuslice_common.models import (
    PLACEMENT_ANNOTATION,
    DeviceSelector,
    Placement,
    PlacementState,
    PodGpuRequest,
    PodRef,
)
from gpuslice_common.nominations import Nominations
from gpuslice_common.outbox import Outbox
from gpuslice_common.requests import RequestError, parse_pod
from gpuslice_scheduler.engine import (
    Ceiling,
    Demand,
    Evaluation,
    Evaluator,
    normalise,
    placement,
)
from gpuslice_scheduler.fit import REASONS, CardDemand, Code
from gpuslice_scheduler.fragmentation import MixLearner, WorkloadMix
from gpuslice_scheduler.holders import MAX_NODES, Freed, HolderCheck
from gpuslice_scheduler.metrics import Metrics
from gpuslice_scheduler.preemption import Preemptor
from gpuslice_scheduler.requested import ResourceError, pod_request
from gpuslice_scheduler.vendorannotations import EncodingError, vendor_annotations
from gpuslice_scheduler.view import ClusterView
from gpuslice_scheduler.wire import BindingArgs, ExtenderArgs, PreemptionArgs, filter_error

log = logging.getLogger(__name__)

SOURCE = "gpuslice-scheduler"
WARM_KINDS = 64  # kinds of pod evaluated with a new mix before it is put in place
PARSED = 64  # pods whose parsed request is kept for the verbs that follow
UNKNOWN_NODE = "CardNotFound: no GPU of this node is registered with gpuslice"


SERVES_DRA = "NodeServesDra"


def serves_dra(node: str, *, named: bool = True) -> str:
    """Why a device-plugin GPU pod never goes to ``node``: its cards are DRA's
    (``named``: after the reason's name, as filter reasons are)."""
    line = f"node {node} serves GPUs through DRA (ResourceClaims)"
    return f"{SERVES_DRA}: {line}" if named else line


SERVES_DEVICE_PLUGIN = "NodeServesDevicePlugin"
CLAIM_POLICY = "dra-claim"  # the placements metric's label for a DRA pod's bind


def serves_device_plugin(node: str, *, named: bool = True) -> str:
    """Why a pod claiming its GPUs (DRA) never goes to ``node``."""
    line = f"node {node} serves GPUs through the device plugin"
    return f"{SERVES_DEVICE_PLUGIN}: {line}" if named else line


REBUILDING = (
    "NodeLedgerRebuilding: the node's reservations are being restored from its pods "
    "(Redis lost its data or the node is new); it takes pods again shortly"
)


# the end of a HostPriority for each score: {"Host":<name>,"Score": + this
SCORE_CLOSINGS = [b"%d}" % score for score in range(11)]


def _lower_priority() -> None:
    """Make the calling thread the last to get a core (Linux: niceness is per thread).

    A new workload mix is evaluated in a thread while requests are answered; the
    compiled core releases the GIL, so that thread competes for the cores with
    the verbs, Redis and NATS unless it yields to them."""
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: no setpriority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _uid(pod: dict[str, Any]) -> str:
    metadata = pod.get("metadata")
    uid = metadata.get("uid") if isinstance(metadata, dict) else None
    return uid if isinstance(uid, str) else ""


class BindError(Exception):
    """A bind that did not happen; the message is what kube-scheduler shows."""


class Extender:
    def __init__(
        self,
        settings: SchedulerSettings,
        ledger: Ledger,
        view: ClusterView,
        kube: KubeApi,
        events: Outbox | None = None,
        metrics: Metrics | None = None,
        learner: MixLearner | None = None,
    ) -> None:
        self.settings = settings
        self.ledger = ledger
        self.view = view
        self.kube = kube
        self.events = events
        self.metrics = metrics or Metrics()
        self.learner = learner or MixLearner()
        self._current: Evaluator | None = None
        # per node with MIG cards: binds there take turns (see _reserve)
        self._mig_binds: dict[str, asyncio.Lock] = {}
        self._ceiling = Ceiling(view.cluster)
        self._warming: asyncio.Task[None] | None = None
        # one thread, at the lowest CPU priority: the verbs come first
        self._warmer = ThreadPoolExecutor(1, "mix-warm-up", initializer=_lower_priority)
        self._parsed: dict[tuple[str, str], PodGpuRequest | None] = {}
        # the API server's word on pods holding cards a pending pod needs; not
        # with the in-memory API, which knows only the pods it was shown
        self.holders: HolderCheck | None = None
        if settings.free_ended_holders and settings.kube_api == "cluster":
            self.holders = HolderCheck(ledger, kube, self.metrics, self._announce_freed)
        self.preemptor: Preemptor | None = None
        if settings.preemption:
            self.preemptor = Preemptor(
                ledger,
                view,
                kube,
                Nominations(ledger),
                self.metrics,
                self._send,
                self._held_request,
                settings.nomination_ttl.total_seconds(),
            )

    # ------------------------------------------------------------ reading verbs

    def _demand(self, pod: dict[str, Any]) -> Demand | None:
        """The pod as the engine sees it; None for a pod without GPUs that is not
        scored (``score_cpu_pods`` off, or no node's CPU and memory known)."""
        request = self._parse(pod)
        if request is None:
            return self._cpu_demand(pod)
        cpu, memory = self._node_request(pod)
        demand = Demand.of(
            request,
            self.settings.requests.default_gpu_policy,
            cpu=cpu,
            memory=memory,
            default_node_policy=self.settings.requests.default_node_policy,
        )
        main = max(request.containers, key=lambda c: (c.count, c.cores))
        self.learner.observe(request.pod.uid, CardDemand.of(main), request.selector, cpu, memory)
        return demand

    def _cpu_demand(self, pod: dict[str, Any]) -> Demand | None:
        """A pod without GPUs as the trace replay scores it (request None, its CPU
        and memory): it goes where it strands the fewest GPUs. Without a known
        node CPU and memory, or a request of neither, every node is alike."""
        if not self.settings.score_cpu_pods:
            return None
        cpu, memory = self._node_request(pod)
        if cpu <= 0 and memory <= 0:
            return None
        uid = (pod.get("metadata") or {}).get("uid")
        if isinstance(uid, str) and uid:
            self.learner.observe(uid, None, DeviceSelector(), cpu, memory)
        return Demand.of(None, self.settings.requests.default_gpu_policy, cpu=cpu, memory=memory)

    def _node_request(self, pod: Mapping[str, Any]) -> tuple[float, float]:
        """The pod's CPU (milli) and memory (MiB) request, where nodes' are followed.

        While no node's CPU and memory are known (no Node objects yet, or an
        API without them: the dev stack's), the request changes no answer, and
        is left out so that pods differing only in it stay one kind for the
        engine. Raises :class:`~gpuslice_scheduler.requested.ResourceError` (a
        RequestError) when a quantity cannot be read."""
        if self.view.resources is None:
            return 0.0, 0.0
        amount = pod_request(pod)
        self.view.follow_resources()
        if not self.view.weighs_resources():
            return 0.0, 0.0
        return float(amount.cpu), amount.memory_mib

    def _held_request(self, pod: Mapping[str, Any]) -> tuple[float, float]:
        """A bound pod's CPU and memory as its node counts them (0 where unreadable:
        its going frees nothing that is counted)."""
        try:
            return self._node_request(pod)
        except ResourceError:
            return 0.0, 0.0

    async def close(self) -> None:
        """Stop background work (a mix being warmed up)."""
        if self._warming is not None:
            self._warming.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._warming
        self._warmer.shutdown(wait=False, cancel_futures=True)

    def _parse(self, pod: dict[str, Any]) -> PodGpuRequest | None:
        """The pod's GPU request; kube-scheduler sends one pod to three verbs, so keep a few.

        Resources of a pod cannot change; annotations can, so they are part of the key.
        """
        metadata = pod.get("metadata")
        uid = metadata.get("uid") if isinstance(metadata, dict) else None
        annotations = metadata.get("annotations") if isinstance(metadata, dict) else None
        if not isinstance(uid, str) or not uid:
            return parse_pod(pod, self.settings.requests)
        key = (uid, repr(sorted(annotations.items())) if isinstance(annotations, dict) else "")
        if key in self._parsed:
            return self._parsed[key]
        request = parse_pod(pod, self.settings.requests)
        self._parsed[key] = request
        if len(self._parsed) > PARSED:
            del self._parsed[next(iter(self._parsed))]
        return request

    def _evaluator(self) -> Evaluator:
        """The engine's per-kind evaluations for the current copy of the ledger.

        A new copy (nodes added or removed) starts afresh at once. A new mix is
        put in place only once the kinds seen last are evaluated with it, in a
        thread beside the requests, so no request pays for a whole re-evaluation.
        """
        cluster, mix = self.view.cluster, self.learner.mix
        current = self._current
        if current is None or current.cluster is not cluster:
            current = self._current = Evaluator(cluster, mix)
            self._ceiling = Ceiling(cluster)
        elif current.mix is not mix and self._warming is None:
            self._warming = asyncio.get_running_loop().create_task(self._warm(current, mix))
        return current

    async def _warm(self, current: Evaluator, mix: WorkloadMix) -> None:
        fresh = Evaluator(current.cluster, mix)
        try:
            for demand in current.recent(WARM_KINDS):
                await asyncio.get_running_loop().run_in_executor(
                    self._warmer, fresh.evaluate, demand
                )
            if self._current is current:
                self._current = fresh
        except Exception:  # the old mix keeps serving; the next change tries again
            log.exception("evaluating with the new workload mix failed")
        finally:
            self._warming = None

    def _evaluate(self, demand: Demand, names: list[str]) -> tuple[Evaluation, list[str]]:
        """Evaluate ``demand`` on the nodes ``names``; also returns the unknown names."""
        self.view.follow_resources()
        nodes, unknown = self.view.node_indexes(names)
        return self._evaluator().evaluate(demand).subset(nodes), unknown

    async def filter(self, args: ExtenderArgs) -> dict[str, Any]:
        local = isinstance(self.kube, LocalKubeApi)
        if local:
            self._learn_nodes(args)  # first: the pod's demand weighs the nodes learned
        try:
            demand = self._demand(args.pod)
        except RequestError as exc:
            log.info("filter: %s", exc)
            return filter_error(f"gpuslice: {exc}")
        if local:  # a pod the parser read: its bind finds it
            assert isinstance(self.kube, LocalKubeApi)
            self.kube.learn(args.pod)
        if demand is None or demand.request is None:  # not a GPU pod: every node passes
            return args.filter_reply(args.node_names, {}, {})
        if has_pod_claim(args.pod):
            return self._filter_claiming(args)
        ev, unknown = self._evaluate(demand, args.node_names)
        if self.holders is not None and not ev.feasible.all():
            full = self._held(demand, ev)
            if full:
                await self._free_held(full, _uid(args.pod), "filter")
                ev, unknown = self._evaluate(demand, args.node_names)
        names = self.view.cluster.names
        passed = names[ev.nodes[ev.feasible]].tolist()  # in the order they were sent
        failed: dict[str, str] = {}
        dra = [n for n in args.node_names if n in self.view.dra]
        if dra:  # a card is never granted by both kubelet's Allocate and a claim
            passed = [n for n in passed if n not in self.view.dra]
        if self.view.rebuilding:
            waiting = [n for n in passed if n in self.view.rebuilding]
            if waiting:
                passed = [n for n in passed if n not in self.view.rebuilding]
                failed.update(dict.fromkeys(waiting, REBUILDING))
                self.metrics.failures.labels("filter", "NodeLedgerRebuilding").inc(len(waiting))
        if self.preemptor is not None and passed:  # rooms held for preempting pods
            nominated = self.preemptor.holds(args.pod, demand, passed)
            if nominated:
                passed = [n for n in passed if n not in nominated]
                failed.update(nominated)
        unresolvable = dict.fromkeys(unknown, UNKNOWN_NODE)
        rows = np.flatnonzero(~ev.feasible)
        if rows.size:
            nodes = ev.nodes[rows]
            never = self._ceiling.never_fit(demand, nodes)  # current: _evaluate
            detail = ev.detail
            note = self._vendor_note(demand.request)
            for part, into in ((~never, failed), (never, unresolvable)):
                lines = [detail[r] + note for r in rows[part].tolist()]
                into.update(zip(names[nodes[part]].tolist(), lines, strict=True))
            codes, counts = np.unique(ev.code[rows], return_counts=True)
            for code, count in zip(codes.tolist(), counts.tolist(), strict=True):
                reason = REASONS.get(Code(code))
                self.metrics.failures.labels("filter", reason or "unknown").inc(count)
        if dra:  # no preemption there can help
            for node in dra:
                failed.pop(node, None)
                unresolvable[node] = serves_dra(node)
            self.metrics.failures.labels("filter", SERVES_DRA).inc(len(dra))
        return args.filter_reply(passed, failed, unresolvable)

    def _vendor_note(self, request: PodGpuRequest) -> str:
        """For another vendor's pod, what a failed node's line adds: the vendor's
        resources the pod asks through, so that its owner sees which request failed."""
        vendor = next(
            (v for v in self.settings.requests.vendors if v.vendor == request.vendor), None
        )
        if vendor is None:
            return ""
        return f" [{vendor.vendor}: {', '.join(vendor.all())}]"

    def _filter_claiming(self, args: ExtenderArgs) -> dict[str, Any]:
        """A DRA pod: its DRA nodes pass, whatever the ledger holds there."""
        _, unknown = self.view.node_indexes(args.node_names)
        unresolvable = dict.fromkeys(unknown, UNKNOWN_NODE)
        passed: list[str] = []
        for node in args.node_names:
            if node in self.view.dra:
                passed.append(node)
            elif node not in unresolvable:
                unresolvable[node] = serves_device_plugin(node)
        others = len(args.node_names) - len(passed) - len(unknown)
        if others:
            self.metrics.failures.labels("filter", SERVES_DEVICE_PLUGIN).inc(others)
        return args.filter_reply(passed, {}, unresolvable)

    def _held(self, demand: Demand, ev: Evaluation) -> list[str]:
        """The nodes ``ev`` failed that could take the pod were their cards
        empty: what reservations hold stands in the way there."""
        rows = np.flatnonzero(~ev.feasible)
        nodes = ev.nodes[rows]
        could = nodes[~self._ceiling.never_fit(demand, nodes)]  # current: _evaluate
        return self.view.cluster.names[could].tolist()  # type: ignore[no-any-return]

    async def _free_held(self, nodes: list[str], pending: str, verb: str) -> None:
        """The fail path (:mod:`gpuslice_scheduler.holders`): release the
        reservations on ``nodes`` of pods the API server says are gone or
        terminal, and read again those of ``nodes`` the ledger changed since the
        copy read them (released here, or by the inventory a moment ago). The
        caller evaluates again: the copy may also have moved on meanwhile by
        itself (a change notice), and nodes it did not change are not evaluated
        again."""
        assert self.holders is not None
        nodes = nodes[:MAX_NODES]
        await self.holders.free(nodes, pending, verb)
        try:
            revs = await self.ledger.revisions(nodes)
            stale = [n for n in nodes if revs.get(n) != self.view.revs.get(n)]
            if stale:
                await self.view.refresh(stale)
        except LedgerError as exc:  # the copy's next sync reads them
            log.info("cannot read again nodes %s: %s", nodes, exc)

    async def _announce_freed(self, freed: Freed) -> None:
        """``alloc.released`` for a reservation the holder check released."""
        record = freed.placement
        payload = AllocationEvent(
            pod=record.pod,
            node=record.node,
            containers=record.containers,
            policy=record.policy,
            reason=freed.reason,
            claim=record.claim,
        )
        await self._send(EventType.ALLOC_RELEASED, payload)

    async def filter_preempting(self, args: ExtenderArgs) -> dict[str, Any]:
        """:meth:`filter`; where a GPU pod fits none of the nodes, GPU preemption
        (:mod:`gpuslice_scheduler.preemption`) on those that failed for a reason
        it can cure: the node it nominates shows why the pod waits there."""
        reply = await self.filter(args)
        passed = reply["NodeNames"] or (reply["Nodes"] or {}).get("items")
        if self.preemptor is None or reply["Error"] or passed:
            return reply
        failed: dict[str, str] = reply["FailedNodes"]
        curable = [n for n in args.node_names if n in failed and failed[n] != REBUILDING]
        if not curable:
            return reply
        demand = self._demand(args.pod)  # parsed by filter already: kept
        if demand is None or demand.request is None:
            return reply
        nominated = await self.preemptor.preempt(args.pod, demand, curable)
        if nominated is not None:
            node, line = nominated
            failed[node] = line
        return reply

    def _learn_nodes(self, args: ExtenderArgs) -> None:
        """With the in-memory API (the dev stack, the trace replay), learn the
        nodes of a filter call that carries full Node objects, as a cluster's API
        server and watches would have them, counted at once."""
        assert isinstance(self.kube, LocalKubeApi)
        if args.nodes is None:
            return
        for node in args.nodes.get("items") or ():
            if not self.kube.learn_node(node):
                continue
            if self.view.resources is not None:  # at once, not at the watch's next turn
                self.view.resources.apply_node("ADDED", node)

    def prioritize(self, args: ExtenderArgs) -> list[dict[str, Any]] | bytes:
        """A HostPriorityList: every node sent, scored 0 to 10. Written straight as
        JSON (bytes) from each node's cached opening, where all nodes are known."""
        demand = self._demand(args.pod)
        if demand is None:
            return [{"Host": n, "Score": 0} for n in args.node_names]
        if demand.request is not None and has_pod_claim(args.pod):
            # a DRA pod: its DRA nodes ranked among themselves, the others 0
            nodes = [n for n in args.node_names if n in self.view.dra]
            ev, _ = self._evaluate(demand, nodes)
            hosts = self.view.cluster.names[ev.nodes].tolist()
            known = dict(zip(hosts, normalise(ev.score), strict=True))
            return [{"Host": n, "Score": known.get(n, 0)} for n in args.node_names]
        ev, unknown = self._evaluate(demand, args.node_names)
        if unknown and demand.request is None:
            # a node with no GPU registered strands none: the best a pod without
            # GPUs can do (the engine's score there would be 0, its maximum)
            hosts = self.view.cluster.names[ev.nodes].tolist()
            raw = dict(zip(hosts, ev.score.tolist(), strict=True))
            ranked = normalise(np.asarray([raw.get(n, 0.0) for n in args.node_names]))
            return [{"Host": n, "Score": s} for n, s in zip(args.node_names, ranked, strict=True)]
        scores = normalise(ev.score)
        if unknown:  # unregistered nodes score 0, in the order they were sent
            hosts = self.view.cluster.names[ev.nodes].tolist()
            known = dict(zip(hosts, scores, strict=True))
            return [{"Host": n, "Score": known.get(n, 0)} for n in args.node_names]
        openings = self.view.cluster.host_openings()
        parts = [
            openings[n] + SCORE_CLOSINGS[s] for n, s in zip(ev.nodes.tolist(), scores, strict=True)
        ]
        return b"[" + b",".join(parts) + b"]"

    async def preempt(self, args: PreemptionArgs) -> dict[str, Any]:
        """kube-scheduler's own victims (found for CPU, memory or other reasons: it
        cannot see GPUs), in MetaVictims form, kept on the nodes where the pod's
        GPUs fit once they are gone (all of them for a pod without GPUs, or with
        preemption off). gpuslice's GPU preemption happens at filter time."""
        if self.preemptor is None or has_pod_claim(args.pod):
            # a DRA pod's device fit is kube-scheduler's own to judge
            return {"NodeNameToMetaVictims": args.victims}
        try:
            demand = self._demand(args.pod)
        except RequestError as exc:
            raise BindError(f"gpuslice: {exc}") from None
        kept = await self.preemptor.narrow(demand, args.victims)
        return {"NodeNameToMetaVictims": kept}

    # ------------------------------------------------------------ bind

    async def bind(self, args: BindingArgs) -> None:
        pod = await self._pod(args)
        bound_to = (pod.get("spec") or {}).get("nodeName")
        if bound_to and bound_to != args.node:
            raise BindError(f"pod {args.pod_namespace}/{args.pod_name} is bound to {bound_to}")
        try:
            demand = self._demand(pod)
        except RequestError as exc:
            raise BindError(f"gpuslice: {exc}") from None
        if demand is not None and demand.request is not None and has_pod_claim(pod):
            await self._bind_claiming(args, pod, bound_to == args.node)
            return
        if demand is None or demand.request is None:  # no GPU: nothing to reserve
            self._assume(pod, args.node)
            try:
                await self._create_binding(args)
            except KubeError as exc:
                if not await self._bound_here(args):
                    self._forget(pod)
                    raise BindError(
                        f"cannot bind {args.pod_namespace}/{args.pod_name}: {exc}"
                    ) from None
            return
        chosen, created = await self._reserve(args, demand)
        if chosen.state is not PlacementState.RESERVED and bound_to == args.node:
            return  # bound before: nothing left to do
        self._assume(pod, args.node)
        try:
            await self._record_and_bind(args, pod, chosen, created)
        except BindError:
            self._forget(pod)
            raise

    async def _bind_claiming(self, args: BindingArgs, pod: dict[str, Any], bound: bool) -> None:
        """A DRA pod: the Binding alone, on a DRA node. Its cards are the claim's,
        recorded when kubelet prepares it; nothing is reserved here."""
        if args.node not in self.view.dra:
            line = serves_device_plugin(args.node, named=False)
            await self._failed(args, SERVES_DEVICE_PLUGIN, line)
            raise BindError(serves_device_plugin(args.node))
        if bound:
            return  # bound before: nothing left to do
        self._assume(pod, args.node)
        try:
            await self._create_binding(args)
        except KubeError as exc:
            if not await self._bound_here(args):
                self._forget(pod)
                await self._failed(args, "BindFailed", str(exc))
                what = f"{args.pod_namespace}/{args.pod_name}"
                raise BindError(f"cannot bind {what}: {exc}") from None
        self.metrics.placements.labels(CLAIM_POLICY).inc()
        log.info(
            "bound %s/%s to %s (its GPUs are its DRA claim's)",
            args.pod_namespace,
            args.pod_name,
            args.node,
        )

    def _assume(self, pod: dict[str, Any], node: str) -> None:
        """Count the pod's CPU and memory on ``node`` now, as its GPU usage is."""
        if self.view.resources is not None:
            self.view.resources.assume(pod, node)

    def _forget(self, pod: dict[str, Any]) -> None:
        if self.view.resources is not None:
            self.view.resources.forget(pod)

    async def _earlier(self, args: BindingArgs) -> Placement | None:
        """The live reservation an earlier bind of this pod made (kube-scheduler retried)."""
        live = await self.ledger.placement(args.pod_uid)
        if live is None or live.state is PlacementState.RELEASED:
            return None
        if live.node != args.node:
            raise BindError(f"pod {args.pod_uid} is reserved on node {live.node}")
        return live

    async def _pod(self, args: BindingArgs) -> dict[str, Any]:
        try:
            pod = await self.kube.get_pod(args.pod_namespace, args.pod_name)
        except KubeError as exc:
            raise BindError(
                f"cannot read pod {args.pod_namespace}/{args.pod_name}: {exc}"
            ) from None
        uid = (pod.get("metadata") or {}).get("uid")
        if uid != args.pod_uid:
            raise BindError(
                f"pod {args.pod_namespace}/{args.pod_name} has UID {uid}, not {args.pod_uid}"
            )
        return pod

    async def _reserve(self, args: BindingArgs, demand: Demand) -> tuple[Placement, bool]:
        """Reserve the pod's cards on the node, or find the reservation it already holds.

        Returns the reservation and whether this call made it.
        """
        assert demand.request is not None
        demand = Demand(
            demand.request.model_copy(
                update={
                    "pod": PodRef(
                        uid=args.pod_uid, namespace=args.pod_namespace, name=args.pod_name
                    )
                }
            ),
            demand.gpu_policy,
            demand.node_policy,
            demand.cpu,
            demand.memory,
        )
        # A MIG instance is a place, not an amount: binds evaluated before one
        # another's reservation is counted pick the same slices, and all but one
        # lose. On a node with MIG cards, this process's binds take turns.
        node = self.view.cluster.node_index.get(args.node)
        if node is None or not self.view.cluster.node_mig[node]:
            return await self._reserve_on(args, demand)
        lock = self._mig_binds.setdefault(args.node, asyncio.Lock())
        async with lock:
            return await self._reserve_on(args, demand)

    async def _reserve_on(self, args: BindingArgs, demand: Demand) -> tuple[Placement, bool]:
        if args.node in self.view.dra:  # the ledger refuses it too (NodeServesDra)
            await self._failed(args, SERVES_DRA, serves_dra(args.node, named=False))
            raise BindError(serves_dra(args.node))
        for attempt in range(2):
            ev, unknown = self._evaluate(demand, [args.node])
            if unknown:
                raise BindError(f"node {args.node}: {UNKNOWN_NODE}")
            if not ev.feasible[0]:
                earlier = await self._earlier(args)  # its own reservation fills the node
                if earlier is not None:
                    return earlier, False
                if attempt == 0 and await self._bind_freed(args, demand, ev):
                    continue
                reason = ev.reason(0)
                await self._failed(args, reason.value if reason else "unknown", ev.detail[0])
                raise BindError(f"node {args.node} cannot take the pod: {ev.detail[0]}")
            chosen = placement(self.view.cluster, demand, ev, 0)
            try:
                reserved, created, rev = await self.ledger.reserve_new(chosen)
            except ReservationConflict as exc:
                await self._reread(args.node)
                if attempt == 0:
                    if self.holders is not None:
                        await self.holders.free([args.node], args.pod_uid, "bind")
                        await self._reread(args.node)
                    continue
                await self._failed(args, exc.reason, str(exc))
                raise BindError(
                    f"lost a race for {exc.uuid} on {args.node}: {exc.reason}"
                ) from None
            except AlreadyReserved as exc:
                raise BindError(str(exc)) from None
            except LedgerRebuilding as exc:
                self.metrics.failures.labels("bind", "NodeLedgerRebuilding").inc()
                await self._reread(args.node)  # the filter skips it meanwhile
                raise BindError(f"gpuslice: {exc}") from None
            except LedgerError as exc:
                raise BindError(f"ledger: {exc}") from None
            if created:
                self.view.apply(reserved, rev)
                await self._publish(EventType.ALLOC_RESERVED, reserved)
            return reserved, created
        raise BindError(f"node {args.node} keeps changing; try again")  # pragma: no cover

    async def _bind_freed(self, args: BindingArgs, demand: Demand, ev: Evaluation) -> bool:
        """A bind on a node the copy finds short: whether the holder check ran
        there (reservations of ended pods released, the copy read again): then
        evaluate once more."""
        if self.holders is None:
            return False
        held = self._held(demand, ev)
        if held:
            await self._free_held(held, args.pod_uid, "bind")
        return bool(held)

    async def _reread(self, node: str) -> None:
        """Read ``node`` from the ledger again; if Redis cannot answer, the next
        sync does (the node's revision moved)."""
        with contextlib.suppress(LedgerError):
            await self.view.refresh_node(node)

    async def _record_and_bind(
        self, args: BindingArgs, pod: dict[str, Any], chosen: Placement, created: bool
    ) -> None:
        try:
            # other vendors' plugins read HAMi's annotations at Allocate
            vendors = self.settings.requests.vendors
            cards = self.view.card_facts(chosen.node)
            annotations = vendor_annotations(pod, chosen, vendors, cards, time.time_ns())
            annotations[PLACEMENT_ANNOTATION] = chosen.to_annotation()
            await self.kube.patch_pod_annotations(args.pod_namespace, args.pod_name, annotations)
            if chosen.state is PlacementState.RESERVED:
                await self._bind_in_turn(args)
            await self._create_binding(args)
        except (KubeError, LedgerError, BindError, EncodingError) as exc:
            if isinstance(exc, KubeError) and await self._bound_here(args):
                pass  # the Binding exists after all (a lost reply, or another bind of the pod)
            else:
                if created:  # a reservation found, not made, belongs to the call that made it
                    await self._undo(args, chosen, str(exc))
                raise BindError(
                    f"bind of {args.pod_namespace}/{args.pod_name} failed: {exc}"
                ) from None
        self.metrics.placements.labels(chosen.policy or "unknown").inc()
        await self._publish(EventType.ALLOC_BOUND, chosen)
        if self.preemptor is not None:  # a nominated pod bound: its held room is its own now
            await self.preemptor.bound(args.pod_uid)

    async def _bind_in_turn(self, args: BindingArgs) -> None:
        """Mark the reservation bound once no other pod bound to the node waits for
        kubelet's Allocate (kubelet's call names no pod: with one such pod per
        node, each call is that pod's). Waits up to ``bind_wait`` for the pod the
        node is taking, well inside kube-scheduler's extender timeout; then the
        bind fails and kube-scheduler tries again after its backoff."""
        wait = self.settings.bind_wait.total_seconds()
        try:
            _, waited = await self.ledger.mark_bound_in_turn(
                args.pod_uid, args.node, wait, self.view.changed
            )
        except NodeBusy as exc:
            self.metrics.bind_turns.labels("gave-up").inc()
            raise BindError(f"{exc}; kube-scheduler tries again") from None
        self.metrics.bind_turns.labels("waited" if waited else "at-once").inc()

    async def _create_binding(self, args: BindingArgs) -> None:
        await self.kube.bind_pod(args.pod_namespace, args.pod_name, args.pod_uid, args.node)

    async def _bound_here(self, args: BindingArgs) -> bool:
        """Is the pod (this UID) bound to the node, whatever the last call said?"""
        try:
            pod = await self.kube.get_pod(args.pod_namespace, args.pod_name)
        except KubeError:
            return False
        metadata, spec = pod.get("metadata") or {}, pod.get("spec") or {}
        return metadata.get("uid") == args.pod_uid and spec.get("nodeName") == args.node

    async def _undo(self, args: BindingArgs, chosen: Placement, why: str) -> None:
        try:
            # no Binding was made: kubelet cannot be admitting it (no ghost)
            await self.ledger.release(args.pod_uid, f"bind failed: {why}", kubelet_may_admit=False)
        except LedgerError as exc:  # inventory's reservation TTL frees it later
            log.error("cannot release pod %s after a failed bind: %s", args.pod_uid, exc)
        await self._reread(args.node)
        await self._failed(args, "BindFailed", why, chosen)

    async def _failed(
        self, args: BindingArgs, reason: str, detail: str, chosen: Placement | None = None
    ) -> None:
        self.metrics.failures.labels("bind", reason).inc()
        log.info(
            "bind %s/%s on %s failed: %s", args.pod_namespace, args.pod_name, args.node, detail
        )
        payload = AllocationEvent(
            pod=PodRef(uid=args.pod_uid, namespace=args.pod_namespace, name=args.pod_name),
            node=args.node,
            containers=chosen.containers if chosen else (),
            policy=chosen.policy if chosen else "",
            reason=f"{reason}: {detail}"[:1024],
        )
        await self._send(EventType.ALLOC_FAILED, payload)

    async def _publish(self, event_type: EventType, chosen: Placement) -> None:
        payload = AllocationEvent(
            pod=chosen.pod, node=chosen.node, containers=chosen.containers, policy=chosen.policy
        )
        await self._send(event_type, payload)

    async def _send(self, event_type: EventType, payload: AllocationEvent) -> None:
        """Hand the event to the outbox: it is kept until the audit stream stored it."""
        if self.events is None or payload.pod is None:
            return
        self.events.submit(make_event(event_type, payload, source=SOURCE, subject=payload.pod.uid))
