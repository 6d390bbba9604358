"""NATS subjects: the names in DESIGN.md's Bus table, reversible node tokens, wildcards."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuslice_common.events import EventType
from gpuslice_common.subjects import Subjects, node_from_token, node_token, uid_token

UID = "0b6f1d2e-5c51-4f0b-9d43-2c1f8a7e9b10"

# The 253-character limit of a Kubernetes node name (an RFC 1123 subdomain).
LONGEST_NODE = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])
assert len(LONGEST_NODE) == 253


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: '*' is one token, a final '>' is one or more tokens."""
    p, s = pattern.split("."), subject.split(".")
    if p[-1] == ">":
        return len(s) >= len(p) and all(a in ("*", b) for a, b in zip(p[:-1], s, strict=False))
    return len(p) == len(s) and all(a in ("*", b) for a, b in zip(p, s, strict=True))


def valid_subject(subject: str) -> bool:
    """Non-empty tokens with no whitespace: what nats-server accepts for a publish."""
    return all(t and not re.search(r"\s", t) for t in subject.split("."))


# ---------------------------------------------------------------- the Bus table


def test_default_prefix_is_gpuslice() -> None:
    assert Subjects().prefix == "gpuslice"
    assert Subjects() == Subjects("gpuslice")


def test_inventory_subject() -> None:
    assert Subjects().inventory("gpu-node-1") == "gpuslice.inventory.gpu-node-1"


def test_telemetry_subject() -> None:
    assert Subjects().telemetry("gpu-node-1", UID) == f"gpuslice.telemetry.gpu-node-1.{UID}"


EVENT_SUBJECTS = {
    EventType.POD_ADMITTED: "gpuslice.events.pod.admitted",
    EventType.POD_DENIED: "gpuslice.events.pod.denied",
    EventType.ALLOC_RESERVED: "gpuslice.events.alloc.reserved",
    EventType.ALLOC_BOUND: "gpuslice.events.alloc.bound",
    EventType.ALLOC_ALLOCATED: "gpuslice.events.alloc.allocated",
    EventType.ALLOC_RELEASED: "gpuslice.events.alloc.released",
    EventType.ALLOC_FAILED: "gpuslice.events.alloc.failed",
    EventType.ALLOC_PREEMPTED: "gpuslice.events.alloc.preempted",
    EventType.ENFORCE_MEMORY_KILL: "gpuslice.events.enforce.memory-kill",
    EventType.ENFORCE_THROTTLE: "gpuslice.events.enforce.throttle",
    EventType.ENFORCE_COMPUTE_KILL: "gpuslice.events.enforce.compute-kill",
    EventType.ENFORCE_UNGRANTED_KILL: "gpuslice.events.enforce.ungranted-kill",
}


def test_the_event_table_covers_every_event_type() -> None:
    assert set(EVENT_SUBJECTS) == set(EventType)


@pytest.mark.parametrize("event_type", list(EventType))
def test_event_subject(event_type: EventType) -> None:
    subjects = Subjects()
    assert subjects.event(event_type) == EVENT_SUBJECTS[event_type]
    assert matches(subjects.events_all, subjects.event(event_type))


def test_event_subjects_are_distinct() -> None:
    subjects = Subjects()
    assert len({subjects.event(t) for t in EventType}) == len(EventType)


def test_a_custom_prefix_replaces_the_first_token() -> None:
    subjects = Subjects("my-co")
    assert subjects.inventory("n1") == "my-co.inventory.n1"
    assert subjects.telemetry("n1", UID) == f"my-co.telemetry.n1.{UID}"
    assert subjects.event(EventType.ALLOC_BOUND) == "my-co.events.alloc.bound"
    assert subjects.inventory_all == "my-co.inventory.*"
    assert subjects.telemetry_all == "my-co.telemetry.*.*"
    assert subjects.events_all == "my-co.events.>"
    assert subjects.pod_ended == "my-co.pods.ended"


# ---------------------------------------------------------------- node and uid tokens


@pytest.mark.parametrize(
    ("node", "token"),
    [
        ("n1", "n1"),
        ("gpu-node-1", "gpu-node-1"),
        ("gpu-1.example.com", "gpu-1_example_com"),
        ("ip-10-0-1-7.ec2.internal", "ip-10-0-1-7_ec2_internal"),
        ("10.0.0.1", "10_0_0_1"),
        ("a", "a"),
        (LONGEST_NODE, LONGEST_NODE.replace(".", "_")),
    ],
)
def test_node_names_with_dots_map_to_underscores_and_back(node: str, token: str) -> None:
    assert node_token(node) == token
    assert node_from_token(token) == node
    assert Subjects().inventory(node) == f"gpuslice.inventory.{token}"
    assert Subjects().inventory(node).count(".") == 2


@pytest.mark.parametrize(
    "node",
    [
        "",
        "GPU-1",
        "Gpu",
        "gpu_1",
        "gpu*",
        "*",
        ">",
        "gpu>",
        "gpu 1",
        " gpu",
        "gpu\t1",
        "-gpu",
        "gpu-",
        ".gpu",
        "gpu.",
        "gpu..1",
        "gpu/1",
        "gpü",
        "gpu\n",  # a regex '$' alone would let a trailing newline through
        LONGEST_NODE + "d",  # 254 characters
        "a" * 254,
    ],
)
def test_invalid_node_names_raise(node: str) -> None:
    subjects = Subjects()
    with pytest.raises(ValueError, match="not a Kubernetes node name"):
        node_token(node)
    with pytest.raises(ValueError, match="not a Kubernetes node name"):
        subjects.inventory(node)
    with pytest.raises(ValueError, match="not a Kubernetes node name"):
        subjects.telemetry(node, UID)
    with pytest.raises(ValueError, match="not a Kubernetes node name"):
        subjects.telemetry_node(node)


@pytest.mark.parametrize("uid", [UID, "abc", "A_b-9", "x" * 128])
def test_valid_pod_uids_pass_through(uid: str) -> None:
    assert uid_token(uid) == uid
    assert Subjects().telemetry("n1", uid).split(".") == ["gpuslice", "telemetry", "n1", uid]


@pytest.mark.parametrize("uid", ["", ".", "a.b", "*", ">", "a*", "a b", "x" * 129, "uid\n"])
def test_invalid_pod_uids_raise(uid: str) -> None:
    with pytest.raises(ValueError, match="not a pod UID"):
        uid_token(uid)
    with pytest.raises(ValueError, match="not a pod UID"):
        Subjects().telemetry("n1", uid)


# ---------------------------------------------------------------- prefix and audit stream


@pytest.mark.parametrize("prefix", ["gpuslice", "my-co", "t_1", "A", "t0123456789"])
def test_valid_prefixes(prefix: str) -> None:
    subjects = Subjects(prefix)
    assert subjects.inventory("n1").split(".")[0] == prefix
    assert valid_subject(subjects.inventory("n1"))


@pytest.mark.parametrize("prefix", ["", "a.b", ".a", "a.", "a b", "*", ">", "a*", "a>", "a\n", "ä"])
def test_invalid_prefixes_raise(prefix: str) -> None:
    with pytest.raises(ValueError, match="subject prefix must be one token"):
        Subjects(prefix)


def test_subjects_are_frozen() -> None:
    subjects = Subjects()
    with pytest.raises(dataclasses.FrozenInstanceError):
        subjects.prefix = "other"  # type: ignore[misc]
    assert subjects.prefix == "gpuslice"


@pytest.mark.parametrize(
    ("prefix", "stream"),
    [
        ("gpuslice", "gpuslice_audit"),
        ("my-co", "my-co_audit"),
        ("my_co", "my_co_audit"),
        ("My_co", "My_co_audit"),
        ("tabc123", "tabc123_audit"),
    ],
)
def test_audit_stream_name_is_derived_from_the_prefix(prefix: str, stream: str) -> None:
    name = Subjects(prefix).audit_stream
    assert name == stream  # distinct prefixes never share a stream
    # JetStream stream names may not contain '.', '*', '>', '/', '\\' or whitespace
    assert re.fullmatch(r"[A-Za-z0-9_-]+", name)


# ---------------------------------------------------------------- wildcards


def test_wildcards() -> None:
    subjects = Subjects()
    assert subjects.inventory_all == "gpuslice.inventory.*"
    assert subjects.telemetry_node("gpu-1.example.com") == "gpuslice.telemetry.gpu-1_example_com.*"
    assert subjects.telemetry_all == "gpuslice.telemetry.*.*"
    assert subjects.events_all == "gpuslice.events.>"


def test_wildcards_match_exactly_their_subjects() -> None:
    s = Subjects()
    inv = s.inventory("gpu-1.example.com")
    tel = s.telemetry("gpu-1.example.com", UID)
    other_tel = s.telemetry("gpu-2.example.com", UID)
    ev = s.event(EventType.ALLOC_BOUND)
    assert matches(s.inventory_all, inv)
    assert not matches(s.inventory_all, tel)
    assert matches(s.telemetry_all, tel)
    assert matches(s.telemetry_node("gpu-1.example.com"), tel)
    # a container credential for one node may not publish another node's telemetry
    assert not matches(s.telemetry_node("gpu-1.example.com"), other_tel)
    assert not matches(s.telemetry_node("gpu-1"), tel)
    assert matches(s.events_all, ev)
    assert not matches(s.events_all, inv)
    assert not matches(Subjects("other").events_all, ev)
    for wildcard in (s.inventory_all, s.telemetry_all, s.events_all):
        assert not matches(wildcard, s.pod_ended)


# ---------------------------------------------------------------- properties

LABEL = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", fullmatch=True)
NODE = st.lists(LABEL, min_size=1, max_size=6).map(".".join).filter(lambda name: len(name) <= 253)


@settings(max_examples=200, deadline=None)
@given(NODE)
def test_node_tokens_round_trip(node: str) -> None:
    token = node_token(node)
    assert node_from_token(token) == node
    assert not set(token) & {".", "*", ">"}
    assert not re.search(r"\s", token)
    subject = Subjects().inventory(node)
    assert subject.split(".") == ["gpuslice", "inventory", token]
    assert matches(Subjects().inventory_all, subject)


@settings(max_examples=200, deadline=None)
@given(NODE, NODE)
def test_distinct_nodes_get_distinct_tokens(a: str, b: str) -> None:
    assert (node_token(a) == node_token(b)) == (a == b)
    assert matches(Subjects().telemetry_node(a), Subjects().telemetry(b, UID)) == (a == b)


def test_node_request_subjects_carry_the_node_and_parse_back() -> None:
    subjects = Subjects("gs")
    subject = subjects.node_request("gpu-1.example.com", "allocate")
    assert subject == "gs.node.gpu-1_example_com.allocate"
    assert subjects.parse_node_request(subject) == ("gpu-1.example.com", "allocate")
    assert subjects.node_requests("gpu-1") == "gs.node.gpu-1.>"
    assert subjects.node_requests_all == "gs.node.*.*"
    for bad in (
        "gs.node.gpu-1",
        "gs.node.GPU.ping",
        "other.node.n.ping",
        "gs.node.n.Ping",
        "gs.node.n.a.b",
    ):
        assert subjects.parse_node_request(bad) is None
    with pytest.raises(ValueError, match="not a request verb"):
        subjects.node_request("gpu-1", "all.of.them")
