"""GPU preemption in the extender over real HTTP, a real Redis ledger and a local
API: the nomination held across filter calls, the room kept from pods of lower
priority, a forged priority in the request body, kube-scheduler's own proposal."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.test_extender import Stack, args, gpu_pod
from tests.test_extender import stack as stack  # the fixture

NODE = "node-a"  # two cards of 16 GiB


def prioritised(name: str, priority: int, **kwargs: Any) -> dict[str, Any]:
    pod = gpu_pod(name, **kwargs)
    pod["spec"]["priority"] = priority
    return pod


async def place(stack: Stack, pod: dict[str, Any], node: str = NODE) -> None:
    await stack.add(pod)
    reply = (await stack.post("filter", args(pod, node))).json()
    assert reply["NodeNames"] == [node], reply
    assert (await stack.bind(pod, node)).json()["Error"] == ""
    for container in pod["spec"]["containers"]:  # kubelet admits it: its containers allocated
        await stack.ledger.allocate(node, int(container["resources"]["limits"]["nvidia.com/gpu"]))
    stack.kube.set_phase("team", pod["metadata"]["name"], "Running")


async def fill(stack: Stack) -> None:
    """Node-a's two cards, each held whole by a pod of priority 10 (low-b the younger)."""
    for name, started in (("low-a", "2025-01-01T00:00:00Z"), ("low-b", "2025-02-01T00:00:00Z")):
        pod = prioritised(name, 10)
        pod["metadata"]["creationTimestamp"] = started
        await place(stack, pod)


async def view_sees(stack: Stack, check: Any, timeout: float = 10) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "the extender's copy never caught up"
        await asyncio.sleep(0.02)


async def test_a_nomination_is_kept_across_filters_and_its_room_held_until_it_binds(
    stack: Stack,
) -> None:
    await fill(stack)
    high = await stack.add(prioritised("high", 1000))
    reply = (await stack.post("filter", args(high, NODE))).json()
    assert reply["NodeNames"] == []
    assert reply["FailedNodes"][NODE].startswith("GpuPreemption"), reply
    assert stack.kube.evictions == [("team", "low-b")]  # the younger of two equals
    assert (await stack.kube.get_pod("team", "high"))["status"]["nominatedNodeName"] == NODE
    # filter again (kube-scheduler retries while the victim ends): no second victim
    again = (await stack.post("filter", args(high, NODE))).json()
    assert again["FailedNodes"][NODE].startswith("GpuPreemption")
    assert stack.kube.evictions == [("team", "low-b")]

    # the victim ends: its card is free, and held for "high" only
    await stack.ledger.release("uid-low-b", "ended")
    await view_sees(stack, lambda: stack.extender.view.cluster.used_mem.sum() < 2 * 16384)
    for name, priority in (("equal", 1000), ("lower", 10)):
        other = prioritised(name, priority)
        other["spec"]["preemptionPolicy"] = "Never"  # it could evict low-a: not the point here
        await stack.add(other)
        reply = (await stack.post("filter", args(other, NODE))).json()
        assert reply["NodeNames"] == [], (name, reply)
        assert reply["FailedNodes"][NODE].startswith("GpuRoomNominated"), reply
        assert "team/high (priority 1000)" in reply["FailedNodes"][NODE]
    higher = await stack.add(prioritised("higher", 2000))
    assert (await stack.post("filter", args(higher, NODE))).json()["NodeNames"] == [NODE]

    await place(stack, high)
    assert await stack.extender.preemptor.nominations.get("uid-high") is None  # type: ignore[union-attr]
    assert stack.extender.preemptor.live == []  # type: ignore[union-attr]


async def test_a_priority_forged_in_the_request_is_not_believed(stack: Stack) -> None:
    await fill(stack)
    stored = await stack.add(prioritised("forger", 0))
    claimed = prioritised("forger", 1_000_000)  # what a forged body would say
    claimed["metadata"]["uid"] = stored["metadata"]["uid"]
    reply = (await stack.post("filter", args(claimed, NODE))).json()
    assert reply["NodeNames"] == []
    assert not reply["FailedNodes"][NODE].startswith("GpuPreemption")
    assert stack.kube.evictions == []
    await a_genuine_preemptor_evicts(stack)


async def a_genuine_preemptor_evicts(stack: Stack) -> None:
    """The control: a pod the API server gave a high priority does preempt here."""
    genuine = await stack.add(prioritised("genuine", 1000))
    reply = (await stack.post("filter", args(genuine, NODE))).json()
    assert reply["FailedNodes"][NODE].startswith("GpuPreemption"), reply
    assert stack.kube.evictions == [("team", "low-b")]


async def test_a_pod_without_gpus_or_of_policy_never_preempts_nothing(stack: Stack) -> None:
    await fill(stack)
    never = prioritised("never", 1000)
    never["spec"]["preemptionPolicy"] = "Never"
    await stack.add(never)
    reply = (await stack.post("filter", args(never, NODE))).json()
    assert not reply["FailedNodes"][NODE].startswith("GpuPreemption")
    cpu = {
        "metadata": {"name": "cpu", "namespace": "team", "uid": "uid-cpu"},
        "spec": {"priority": 1000, "containers": [{"name": "main"}]},
    }
    await stack.add(cpu)
    assert (await stack.post("filter", args(cpu, NODE))).json()["NodeNames"] == [NODE]
    assert stack.kube.evictions == []
    await a_genuine_preemptor_evicts(stack)


async def test_kube_schedulers_own_victims_are_kept_only_where_they_free_gpu_room(
    stack: Stack,
) -> None:
    await fill(stack)
    high = await stack.add(prioritised("high", 1000))

    async def proposal(victims: dict[str, list[str]]) -> dict[str, Any]:
        body = {
            "Pod": high,
            "NodeNameToMetaVictims": {
                node: {"Pods": [{"UID": uid} for uid in uids], "NumPDBViolations": 0}
                for node, uids in victims.items()
            },
        }
        reply = await stack.post("preempt", body)
        assert reply.status_code == 200, reply.text
        result: dict[str, Any] = reply.json()["NodeNameToMetaVictims"]
        return result

    # a CPU pod as the only victim frees no card: the node is no candidate
    assert await proposal({NODE: ["uid-some-cpu-pod"]}) == {}
    # one of the GPU holders frees a card: kept as proposed
    kept = await proposal({NODE: ["uid-low-a", "uid-some-cpu-pod"]})
    assert list(kept) == [NODE]
    assert kept[NODE]["Pods"] == [{"UID": "uid-low-a"}, {"UID": "uid-some-cpu-pod"}]
    # a node that fits already stays a candidate too
    assert list(await proposal({"node-b": []})) == ["node-b"]
    assert stack.kube.evictions == []  # kube-scheduler evicts its own; the verb only narrows


async def test_a_filter_with_node_objects_preempts_too(stack: Stack) -> None:
    """kube-scheduler's nodeCacheCapable=false form: the nodes as objects."""
    await fill(stack)
    high = await stack.add(prioritised("high", 1000))
    body = {"Pod": high, "Nodes": {"items": [{"metadata": {"name": NODE}}]}}
    reply = (await stack.post("filter", body)).json()
    assert reply["Nodes"]["items"] == []
    assert reply["FailedNodes"][NODE].startswith("GpuPreemption"), reply
    assert stack.kube.evictions == [("team", "low-b")]


async def test_a_nomination_whose_victims_are_gone_is_kept_while_the_pod_fits_there(
    stack: Stack,
) -> None:
    """A replica whose copy of the ledger has not yet seen the victims' release
    must not take the pod's room for lost and nominate it again."""
    await fill(stack)
    high = await stack.add(prioritised("high", 1000))
    assert (
        (await stack.post("filter", args(high, NODE)))
        .json()["FailedNodes"][NODE]
        .startswith("GpuPreemption")
    )
    preemptor = stack.extender.preemptor
    assert preemptor is not None
    before = await preemptor.nominations.get("uid-high")
    assert before is not None
    assert before.victims == ("uid-low-b",)
    await stack.ledger.release("uid-low-b", "ended")
    demand = stack.extender._demand(high)
    assert demand is not None
    answer = await preemptor.preempt(high, demand, [NODE])
    assert answer is not None
    assert answer[1].startswith("GpuPreemption")
    assert await preemptor.nominations.get("uid-high") == before  # the same, not a new one
    assert stack.kube.evictions == [("team", "low-b")]


async def test_a_nomination_of_a_pod_deleted_or_replaced_is_no_ones(stack: Stack) -> None:
    """A preempting pod deleted (a rollout, a Job's retry) leaves its room to
    no one: the sync drops its nomination, so a replacement does not meet the
    room as held and evict a second set."""
    await fill(stack)
    high = await stack.add(prioritised("high", 1000))
    (await stack.post("filter", args(high, NODE))).json()
    preemptor = stack.extender.preemptor
    assert preemptor is not None
    nomination = await preemptor.nominations.get("uid-high")
    assert nomination is not None
    assert await preemptor._still_waiting(nomination)  # there, not bound: it waits
    stack.kube.delete_pod("team", "high")
    assert not await preemptor._still_waiting(nomination)
    replaced = prioritised("high", 1000, uid="uid-high-2")  # same name, a new UID
    await stack.add(replaced)
    assert not await preemptor._still_waiting(nomination)
