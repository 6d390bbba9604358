"""Nominations in Redis (gpuslice_common.nominations): the claim is atomic across
callers, a pod's live nomination is kept, expired ones go."""

from __future__ import annotations

import asyncio

from gpuslice_common.ledger import Ledger
from gpuslice_common.models import ContainerAssignment, DeviceGrant, Placement, PodRef
from gpuslice_common.nominations import Nomination, Nominations


def on(node: str, uid: str) -> Placement:
    return Placement(
        pod=PodRef(uid=uid, namespace="ns", name=uid),
        node=node,
        containers=(
            ContainerAssignment(
                name="main", devices=(DeviceGrant(uuid=f"GPU-{node}-0", memory_mib=100, cores=10),)
            ),
        ),
    )


async def test_a_claim_is_read_back_as_made(ledger: Ledger) -> None:
    store = Nominations(ledger)
    claim = await store.claim(on("n1", "p1"), 100, ["v1", "v2"], 60, [], store.new_token())
    assert claim.outcome == "ok"
    (got,) = (await store.live())[0]
    assert (got.uid, got.node, got.priority, got.victims) == ("p1", "n1", 100, ("v1", "v2"))
    assert got.placement == on("n1", "p1")
    assert await store.get("p1") == got
    await store.drop(["p1"])
    assert await store.get("p1") is None


async def test_a_second_caller_gets_the_pods_nomination_not_a_second_one(ledger: Ledger) -> None:
    store = Nominations(ledger)
    first = await store.claim(on("n1", "p1"), 100, ["v1"], 60, [], store.new_token())
    second = await store.claim(on("n2", "p1"), 100, ["v9"], 60, [], store.new_token())
    assert first.outcome == "ok"
    assert second.outcome == "held"
    assert second.nomination is not None
    assert (second.nomination.node, second.nomination.victims) == ("n1", ("v1",))


async def test_callers_racing_for_one_pod_make_one_nomination(ledger: Ledger) -> None:
    stores = [Nominations(ledger) for _ in range(8)]
    claims = await asyncio.gather(
        *(
            s.claim(on(f"n{i}", "p1"), 100, [f"v{i}"], 60, [], s.new_token())
            for i, s in enumerate(stores)
        )
    )
    assert sorted(c.outcome for c in claims) == ["held"] * 7 + ["ok"]
    assert len((await stores[0].live())[0]) == 1


async def test_a_nomination_the_caller_did_not_count_makes_it_choose_again(
    ledger: Ledger,
) -> None:
    store = Nominations(ledger)
    assert (await store.claim(on("n1", "p1"), 100, [], 60, [], "t1")).outcome == "ok"
    # p2 chose its victims on n1 without p1's room held: refused
    assert (await store.claim(on("n1", "p2"), 50, [], 60, [], "t2")).outcome == "changed"
    # counted: stored
    assert (await store.claim(on("n1", "p2"), 50, [], 60, ["p1"], "t2")).outcome == "ok"
    # the same call may replace its own
    assert (await store.claim(on("n1", "p2"), 50, ["v"], 60, ["p1"], "t2")).outcome == "ok"


async def test_expired_nominations_are_gone(ledger: Ledger) -> None:
    store = Nominations(ledger)
    assert (await store.claim(on("n1", "p1"), 100, [], 0.05, [], "t1")).outcome == "ok"
    await asyncio.sleep(0.2)
    assert await store.get("p1") is None
    # and no longer stop a claim on the node or of the pod
    assert (await store.claim(on("n1", "p2"), 10, [], 60, [], "t2")).outcome == "ok"
    assert (await store.claim(on("n2", "p1"), 100, [], 60, [], "t3")).outcome == "ok"


async def test_a_record_no_gpuslice_writes_is_left_out_and_named(ledger: Ledger) -> None:
    store = Nominations(ledger)
    await ledger.redis.hset(store.key, "forged", "99999999999999|n1|t|{not json")
    await ledger.redis.hset(
        store.key,
        "other",
        "99999999999999|n1|t|" + Nomination(on("n1", "p1"), 1, (), None).record(),  # type: ignore[arg-type]
    )
    live, problems = await store.live()
    assert live == []
    assert len(problems) == 2
    assert any("forged" in p for p in problems)
