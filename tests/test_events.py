"""CloudEvents 1.0 (structured JSON): building, the wire round trip, and rejection."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuslice_common.events import (
    PAYLOADS,
    AllocationEvent,
    CloudEvent,
    EnforcementEvent,
    EventError,
    EventType,
    PodAdmitted,
    PodDenied,
    make_event,
    parse_event,
)
from gpuslice_common.models import (
    ContainerAssignment,
    ContainerGpuRequest,
    DeviceGrant,
    Frozen,
    MemoryRequest,
    PodRef,
)

POD = PodRef(uid="0b6f1d2e-5c51-4f0b-9d43-2c1f8a7e9b10", namespace="team-a", name="train-0")


def payload_for(t: EventType) -> Frozen:
    """A valid payload for every event type, with the optional parts filled in."""
    if t is EventType.POD_ADMITTED:
        return PodAdmitted(
            pod=POD,
            containers=(
                ContainerGpuRequest(name="init", init=True, count=1, memory=MemoryRequest(mib=1)),
                ContainerGpuRequest(
                    name="main", count=2, memory=MemoryRequest(percent=50), cores=30, priority=0
                ),
            ),
            warnings=("nvidia.com/gpumem ignored: gpumem-percentage given",),
        )
    if t is EventType.POD_DENIED:
        return PodDenied(pod=POD, reason="container 'main': nvidia.com/gpucores above 100")
    if t.value.startswith("io.gpuslice.enforce."):
        return EnforcementEvent(
            pod=POD,
            pod_uid=POD.uid,
            node="gpu-1.example.com",
            container="main",
            card="GPU-a",
            pid=4242,
            used_bytes=3 << 30,
            allowed_bytes=1 << 30,
            busy_percent=97.5,
            share_percent=20,
            frozen_percent=80.0,
            reason="killed process 4242 on GPU-a",
        )
    grants = (
        DeviceGrant(uuid="GPU-a", memory_mib=4096, cores=30),
        DeviceGrant(uuid="GPU-b", memory_mib=4096, cores=30),
    )
    return AllocationEvent(
        pod=POD,
        node="gpu-1.example.com",
        containers=(ContainerAssignment(name="main", devices=grants),),
        container="main" if t is EventType.ALLOC_ALLOCATED else None,
        policy="binpack",
        reason={EventType.ALLOC_RELEASED: "expired", EventType.ALLOC_FAILED: "lost race"}.get(
            t, ""
        ),
    )


def valid_doc(t: EventType = EventType.POD_DENIED) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(make_event(t, payload_for(t), source="/test").to_json())
    return doc


def rejection(raw: bytes | str) -> str:
    with pytest.raises(EventError) as info:
        parse_event(raw)
    return str(info.value)


# ---------------------------------------------------------------- make_event


def test_make_event_fills_the_envelope() -> None:
    before = datetime.now(UTC)
    event = make_event(
        EventType.ALLOC_BOUND, payload_for(EventType.ALLOC_BOUND), source="/scheduler/a"
    )
    after = datetime.now(UTC)
    assert event.specversion == "1.0"
    assert event.source == "/scheduler/a"
    assert event.type is EventType.ALLOC_BOUND
    assert event.datacontenttype == "application/json"
    assert event.subject is None
    assert event.id
    assert event.time.tzinfo is not None
    assert event.time.utcoffset() == timedelta(0)
    assert before <= event.time <= after
    assert event.payload() == payload_for(EventType.ALLOC_BOUND)


def test_make_event_ids_are_unique() -> None:
    p = payload_for(EventType.POD_DENIED)
    ids = {make_event(EventType.POD_DENIED, p, source="/t").id for _ in range(500)}
    assert len(ids) == 500


def test_make_event_takes_explicit_id_time_and_subject() -> None:
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone(timedelta(hours=2)))
    event = make_event(
        EventType.POD_DENIED,
        payload_for(EventType.POD_DENIED),
        source="/webhook",
        subject=POD.uid,
        event_id="evt-1",
        time=when,
    )
    assert (event.id, event.time, event.subject) == ("evt-1", when, POD.uid)
    doc = json.loads(event.to_json())
    assert doc["id"] == "evt-1"
    assert doc["subject"] == POD.uid
    assert doc["time"] == "2026-01-02T03:04:05+02:00"


def test_to_json_leaves_out_unset_optional_attributes() -> None:
    doc = valid_doc()
    assert "subject" not in doc
    assert set(doc) == {"specversion", "id", "source", "type", "time", "datacontenttype", "data"}


@pytest.mark.parametrize(
    ("event_type", "wrong"),
    [
        (EventType.POD_DENIED, EventType.ALLOC_BOUND),
        (EventType.ALLOC_BOUND, EventType.POD_ADMITTED),
        (EventType.POD_ADMITTED, EventType.POD_DENIED),
    ],
)
def test_make_event_rejects_the_wrong_payload_model(
    event_type: EventType, wrong: EventType
) -> None:
    payload = payload_for(wrong)
    expected = PAYLOADS[event_type].__name__
    with pytest.raises(EventError, match=f"carries {expected}, not {type(payload).__name__}"):
        make_event(event_type, payload, source="/t")


def test_every_event_type_has_a_payload_model() -> None:
    assert set(PAYLOADS) == set(EventType)
    for t in EventType:
        assert isinstance(payload_for(t), PAYLOADS[t])


# ---------------------------------------------------------------- round trip


@pytest.mark.parametrize("event_type", list(EventType))
def test_every_event_type_round_trips(event_type: EventType) -> None:
    payload = payload_for(event_type)
    event = make_event(event_type, payload, source="/test", subject=POD.uid)
    raw = event.to_json()
    assert isinstance(raw, bytes)
    parsed = parse_event(raw)
    assert parsed == event
    assert parsed.payload() == payload
    assert type(parsed.payload()) is PAYLOADS[event_type]
    assert parse_event(raw.decode()) == event  # str works as well as bytes
    assert parsed.to_json() == raw


def test_an_event_with_default_payload_fields_round_trips() -> None:
    payload = AllocationEvent(pod=PodRef(uid="u"), node="n1")
    event = make_event(EventType.ALLOC_RELEASED, payload, source="/inventory")
    assert parse_event(event.to_json()).payload() == payload


def test_time_keeps_its_offset() -> None:
    doc = valid_doc()
    doc["time"] = "2026-03-04T05:06:07.5-07:00"
    event = parse_event(json.dumps(doc))
    assert event.time == datetime(2026, 3, 4, 12, 6, 7, 500000, tzinfo=UTC)
    assert event.time.utcoffset() == timedelta(hours=-7)


# ---------------------------------------------------------------- extensions


def test_extension_attributes_are_accepted_and_preserved() -> None:
    doc = valid_doc()
    doc["traceparent"] = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    doc["partitionkey"] = "team-a"
    doc["sequence"] = 7
    event = parse_event(json.dumps(doc))
    assert event.model_extra == {
        "traceparent": doc["traceparent"],
        "partitionkey": "team-a",
        "sequence": 7,
    }
    again = json.loads(event.to_json())
    assert again == doc
    assert parse_event(event.to_json()) == event


# ---------------------------------------------------------------- rejection


def test_non_json_is_rejected() -> None:
    assert rejection(b"\xff\xfe not json").startswith("not JSON")
    assert rejection("{").startswith("not JSON")
    assert rejection("").startswith("not JSON")


@pytest.mark.parametrize("raw", ["[1, 2]", "null", "1", '"event"', "true", "NaN", "1e999"])
def test_non_objects_are_rejected(raw: str) -> None:
    assert rejection(raw) == "an event must be a JSON object"


@pytest.mark.parametrize("attribute", ["id", "source", "type", "time", "specversion", "data"])
def test_missing_required_attributes_are_rejected(attribute: str) -> None:
    doc = valid_doc()
    del doc[attribute]
    message = rejection(json.dumps(doc))
    assert message.startswith("bad CloudEvent envelope")
    assert f"{attribute}: Field required" in message


@pytest.mark.parametrize(
    ("attribute", "value", "complaint"),
    [
        ("specversion", "0.3", "specversion"),
        ("specversion", 1.0, "specversion"),
        ("type", "io.gpuslice.pod.exploded", "type"),
        ("type", "com.example.other", "type"),
        ("id", "", "id"),
        ("id", "x" * 201, "id"),
        ("source", "", "source"),
        ("time", "yesterday", "time"),
        ("time", "2026-01-01T00:00:00", "time"),  # RFC 3339 requires an offset
        ("datacontenttype", "text/plain", "datacontenttype"),
        ("subject", 5, "subject"),
        ("data", [1, 2], "data"),
        ("data", "text", "data"),
        ("data", None, "data"),
    ],
)
def test_bad_envelope_attributes_are_rejected(attribute: str, value: Any, complaint: str) -> None:
    doc = valid_doc()
    doc[attribute] = value
    message = rejection(json.dumps(doc))
    assert message.startswith("bad CloudEvent envelope: ")
    assert f"{complaint}: " in message


@pytest.mark.parametrize(
    ("event_type", "data", "complaint"),
    [
        (EventType.POD_DENIED, {"pod": {"uid": "u"}}, "reason: Field required"),
        (EventType.POD_DENIED, {"pod": {"uid": ""}, "reason": "r"}, "pod.uid: "),
        (EventType.POD_DENIED, {"pod": {"uid": "u"}, "reason": "r", "x": 1}, "x: Extra inputs"),
        (EventType.POD_ADMITTED, {"pod": {"uid": "u"}}, "containers: Field required"),
        (
            EventType.POD_ADMITTED,
            {
                "pod": {"uid": "u"},
                "containers": [{"name": "c", "count": 1, "memory": {"mib": 1, "percent": 5}}],
            },
            "containers.0.memory: ",
        ),
        (EventType.ALLOC_BOUND, {"pod": {"uid": "u"}}, "node: Field required"),
        (
            EventType.ALLOC_BOUND,
            {"pod": {"uid": "u"}, "node": "n", "containers": [{"name": "c", "devices": []}]},
            "containers.0: ",
        ),
        (EventType.ALLOC_FAILED, {}, "pod: Field required"),
    ],
)
def test_data_failing_the_payload_model_is_rejected(
    event_type: EventType, data: dict[str, Any], complaint: str
) -> None:
    doc = valid_doc(event_type)
    doc["data"] = data
    message = rejection(json.dumps(doc))
    assert message.startswith(f"bad {event_type.value} data: ")
    assert complaint in message


def test_data_of_another_type_is_rejected() -> None:
    doc = valid_doc(EventType.POD_DENIED)
    doc["type"] = EventType.ALLOC_BOUND.value
    message = rejection(json.dumps(doc))
    assert message.startswith("bad io.gpuslice.alloc.bound data: ")
    assert "node: Field required" in message


def test_every_problem_is_named() -> None:
    doc = valid_doc()
    del doc["id"]
    doc["specversion"] = "0.3"
    message = rejection(json.dumps(doc))
    assert "id: " in message
    assert "specversion: " in message


def test_hostile_json_is_an_event_error() -> None:
    assert rejection("[" * 100_000 + "]" * 100_000).startswith("not JSON")
    assert rejection('{"a":' * 100_000).startswith("not JSON")
    assert rejection("9" * 5000).startswith("not JSON")  # over int's str-digits limit
    doc = json.dumps(valid_doc())
    assert rejection(doc.replace('"id":', '"big": ' + "9" * 5000 + ', "id":')).startswith(
        "not JSON"
    )


def test_event_error_is_a_value_error() -> None:
    assert issubclass(EventError, ValueError)
    assert isinstance(rejection("[]"), str)


# ---------------------------------------------------------------- properties

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=20,
)
ATTRIBUTES = st.sampled_from(
    ["specversion", "id", "source", "type", "time", "subject", "datacontenttype", "data"]
)


def parses_or_event_error(raw: bytes | str) -> CloudEvent | None:
    try:
        return parse_event(raw)
    except EventError as exc:
        message = str(exc)
    assert message  # every rejection says what is wrong
    return None


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_raise_only_event_error(raw: bytes) -> None:
    assert parses_or_event_error(raw) is None


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=12), JSON, max_size=8))
def test_arbitrary_objects_raise_only_event_error(doc: dict[str, Any]) -> None:
    event = parses_or_event_error(json.dumps(doc))
    assert event is None or parse_event(event.to_json()).to_json() == event.to_json()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(list(EventType)),
    st.dictionaries(ATTRIBUTES | st.text(max_size=12), JSON, max_size=3),
    st.lists(ATTRIBUTES, max_size=2),
)
def test_mangled_events_raise_only_event_error(
    event_type: EventType, changes: dict[str, Any], removed: list[str]
) -> None:
    doc = valid_doc(event_type)
    doc.update(changes)
    for attribute in removed:
        doc.pop(attribute, None)
    event = parses_or_event_error(json.dumps(doc))
    if event is not None:
        # to_json drops attributes set to null, so compare what goes on the wire
        assert parse_event(event.to_json()).to_json() == event.to_json()
        assert isinstance(event.payload(), PAYLOADS[event.type])


@pytest.mark.parametrize(
    ("kwargs", "complaint"),
    [
        ({"source": ""}, "source"),
        ({"source": "/s", "time": datetime(2026, 1, 1)}, "time"),  # naive: no offset
    ],
)
def test_make_event_reports_bad_envelope_values_as_event_errors(
    kwargs: dict[str, Any], complaint: str
) -> None:
    payload = PodDenied(pod=PodRef(uid="u"), reason="r")
    with pytest.raises(EventError, match=complaint):
        make_event(EventType.POD_DENIED, payload, **kwargs)
