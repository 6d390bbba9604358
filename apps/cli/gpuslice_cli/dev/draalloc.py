"""The local stack's stand-in for kube-scheduler's DRA allocator (resource.k8s.io/v1).

:func:`allocate` answers a ResourceClaim's ``status.allocation`` on one node
from that node's ResourceSlices, as kube-scheduler's structured-parameters
allocator (``k8s.io/dynamic-resource-allocation/structured``, with the
DRAConsumableCapacity and DRAPrioritizedList features on) does:

- devices are tried in slice order, then in each slice's ``devices`` order
  (slices of a pool older than its newest generation are left out); for each
  device a request needs, the first device that is free, passes the DeviceClass's
  and the request's selectors and has the capacity left is taken;
- the search is depth first and backtracks: when a later device, request or
  constraint cannot be met, the previous choice is undone and the next device
  tried; the first complete answer wins (devices are not scored);
- requests: ``exactly`` (``allocationMode`` ExactCount with ``count``, default
  1, or All: every matching device of the node, at least one) or
  ``firstAvailable`` subrequests, tried in order (a result names
  ``<request>/<subrequest>``); ``constraints`` matchAttribute and
  distinctAttribute;
- a device with ``allowMultipleAllocations`` is shared: each allocation
  consumes, per capacity of the device, its ``capacity.requests`` rounded up by
  the capacity's ``requestPolicy`` (validRange min/step, validValues), or the
  policy's default, or the whole capacity when neither is given; it fits while
  the other allocations' ``consumedCapacity`` plus this stays within the value.
  Its results carry ``consumedCapacity`` and a ``shareID``. The same shared
  device may serve two devices of one claim, as kube-scheduler allows (a
  distinctAttribute constraint keeps them apart). Any other device is exclusive:
  one allocation holds it whole; capacity requests must not exceed its values;
- selectors: the CEL subset of :mod:`gpuslice_cli.dev.dracel`; an expression
  outside it is refused, and one that fails on a device aborts the allocation,
  as a CEL runtime error does in kube-scheduler.

Refused with :class:`AllocationError` (a message naming what): malformed
objects, unknown device classes, ``adminAccess``, ``tolerations``, devices
with ``consumesCounters``, slices with ``perDeviceNodeSelection`` and selectors
outside the subset. Slices of other nodes, and tainted devices, are not used.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import ROUND_CEILING, Decimal
from typing import Any

from gpuslice_cli.dev.dracel import SelectorError, UnsupportedSelector, compile_selector
from gpuslice_common.requests import RequestError, parse_quantity

EXACT_COUNT = "ExactCount"
ALL = "All"
MAX_RESULTS = 32  # resourceapi.AllocationResultsMaxSize
MAX_STEPS = 100_000  # devices tried per claim before giving up (no answer)

DeviceKey = tuple[str, str, str]  # driver, pool, device
Capacity = dict[str, Decimal]


class AllocationError(ValueError):
    """The claim, a slice, a class or an allocation cannot be handled; the message says which."""


@dataclass
class _Device:
    key: DeviceKey
    view: dict[str, Any]  # what CEL sees: attributes, capacity, driver
    shared: bool
    capacity: dict[str, tuple[Decimal, Mapping[str, Any] | None]]
    node_local: bool
    tainted: bool


@dataclass
class _Request:
    name: str  # "<request>" or "<request>/<subrequest>"
    base: str  # the request's own name (for constraints)
    count: int  # devices; for All, the number found
    all_devices: bool
    selectors: list[Callable[[Mapping[str, Any]], bool]]
    capacity: Capacity  # requested, by capacity name
    klass: str


@dataclass
class _Pick:
    request: _Request
    device: _Device
    consumed: Capacity | None  # shared devices only


@dataclass
class _State:
    exclusive: set[DeviceKey]  # held by other claims or earlier picks
    consumed: dict[DeviceKey, Capacity]  # other claims' and earlier picks' use of shared devices
    picks: list[_Pick] = field(default_factory=list)
    steps: int = 0


def allocate(
    claim: Mapping[str, Any],
    node: str,
    slices: Sequence[Mapping[str, Any]],
    allocated: Sequence[Mapping[str, Any]],
    classes: Mapping[str, Mapping[str, Any]],
) -> dict[str, Any] | None:
    """The claim's ``status.allocation`` on ``node``, or None if it does not fit there.

    ``allocated``: the ``status.allocation`` of the other claims holding devices
    of the node; ``classes``: DeviceClasses by name.
    """
    devices = _devices(slices, node)
    state = _State(set(), {})
    for other in allocated:
        _hold(other, state)
    spec = _map(_map(claim.get("spec"), "claim spec").get("devices") or {}, "claim spec.devices")
    requests = _list(spec.get("requests"), "spec.devices.requests")
    options = [_options(r, i, classes, devices) for i, r in enumerate(requests)]
    constraints = [
        _constraint(c, i) for i, c in enumerate(_list(spec.get("constraints"), "constraints"))
    ]
    if not _search(options, 0, 0, devices, state, constraints):
        return None
    results = []
    for pick in state.picks:
        driver, pool, name = pick.device.key
        result: dict[str, Any] = {
            "request": pick.request.name,
            "driver": driver,
            "pool": pool,
            "device": name,
        }
        if pick.consumed is not None:
            if pick.consumed:
                result["consumedCapacity"] = {k: _quantity(v) for k, v in pick.consumed.items()}
            result["shareID"] = str(uuid.uuid4())
        results.append(result)
    allocation: dict[str, Any] = {"devices": {"results": results}}
    config = _config(spec, classes, [p.request for p in state.picks])
    if config:
        allocation["devices"]["config"] = config
    if any(p.device.node_local for p in state.picks):
        allocation["nodeSelector"] = {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
            ]
        }
    return allocation


# ---------------------------------------------------------------- input


def _map(value: object, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise AllocationError(f"{what} must be an object, got {type(value).__name__}")
    return value


def _list(value: object, what: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise AllocationError(f"{what} must be a list, got {type(value).__name__}")
    return value


def _str(value: object, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise AllocationError(f"{what} must be a non-empty string, got {value!r}")
    return value


def _amount(value: object, what: str) -> Decimal:
    try:
        amount = parse_quantity(value)
    except RequestError as exc:
        raise AllocationError(f"{what}: {exc}") from None
    if amount < 0:
        raise AllocationError(f"{what}: negative quantity {value!r}")
    return amount


def _quantity(value: Decimal) -> str:
    if value == value.to_integral_value():
        return str(int(value))
    return f"{int((value * 1000).to_integral_value(rounding=ROUND_CEILING))}m"


def _devices(slices: Sequence[Mapping[str, Any]], node: str) -> list[_Device]:
    specs = []
    newest: dict[tuple[str, str], int] = {}
    for i, s in enumerate(slices):
        where = f"ResourceSlice #{i}"
        spec = _map(_map(s, where).get("spec"), f"{where} spec")
        if spec.get("perDeviceNodeSelection"):
            raise AllocationError(f"{where}: perDeviceNodeSelection is not supported")
        if spec.get("nodeName") != node and spec.get("allNodes") is not True:
            continue  # another node's, or a node selector's (not evaluated here)
        driver = _str(spec.get("driver"), f"{where} spec.driver")
        pool = _map(spec.get("pool"), f"{where} spec.pool")
        name = _str(pool.get("name"), f"{where} spec.pool.name")
        generation = pool.get("generation", 0)
        if not isinstance(generation, int):
            raise AllocationError(f"{where}: spec.pool.generation must be an integer")
        newest[driver, name] = max(newest.get((driver, name), generation), generation)
        specs.append((where, spec, driver, name, generation))
    out = []
    for where, spec, driver, pool_name, generation in specs:
        if generation < newest[driver, pool_name]:
            continue
        for j, raw in enumerate(_list(spec.get("devices"), f"{where} spec.devices")):
            out.append(_device(_map(raw, f"{where} device #{j}"), where, driver, pool_name, spec))
    return out


def _device(
    raw: Mapping[str, Any], where: str, driver: str, pool: str, spec: Mapping[str, Any]
) -> _Device:
    name = _str(raw.get("name"), f"{where} device name")
    what = f"{where} device {name}"
    if raw.get("consumesCounters"):
        raise AllocationError(f"{what}: consumesCounters is not supported")
    capacity: dict[str, tuple[Decimal, Mapping[str, Any] | None]] = {}
    for cap_name, cap in _map(raw.get("capacity") or {}, f"{what} capacity").items():
        cap = _map(cap, f"{what} capacity {cap_name}")
        policy = cap.get("requestPolicy")
        capacity[cap_name] = (
            _amount(cap.get("value"), f"{what} capacity {cap_name}"),
            None if policy is None else _map(policy, f"{what} capacity {cap_name} requestPolicy"),
        )
    view = {
        "name": name,
        "driver": driver,
        "attributes": _map(raw.get("attributes") or {}, f"{what} attributes"),
    }
    return _Device(
        key=(driver, pool, name),
        view=view,
        shared=raw.get("allowMultipleAllocations") is True,
        capacity=capacity,
        node_local=spec.get("nodeName") is not None,
        tainted=bool(raw.get("taints")),
    )


def _hold(allocation: Mapping[str, Any], state: _State) -> None:
    devices = _map(_map(allocation, "allocation").get("devices") or {}, "allocation devices")
    for i, result in enumerate(_list(devices.get("results"), "allocation results")):
        what = f"allocation result #{i}"
        result = _map(result, what)
        key = (
            _str(result.get("driver"), f"{what} driver"),
            _str(result.get("pool"), f"{what} pool"),
            _str(result.get("device"), f"{what} device"),
        )
        if result.get("shareID") is None:
            state.exclusive.add(key)
            continue
        used = state.consumed.setdefault(key, {})
        for cap_name, value in _map(result.get("consumedCapacity") or {}, what).items():
            used[cap_name] = used.get(cap_name, Decimal(0)) + _amount(value, f"{what} {cap_name}")


def _options(
    raw: object, index: int, classes: Mapping[str, Mapping[str, Any]], devices: list[_Device]
) -> list[_Request]:
    request = _map(raw, f"request #{index}")
    name = _str(request.get("name"), f"request #{index} name")
    exactly, first = request.get("exactly"), request.get("firstAvailable")
    if (exactly is None) == (first is None):
        raise AllocationError(f"request {name}: needs exactly one of exactly and firstAvailable")
    if exactly is not None:
        return [_request(_map(exactly, f"request {name}"), name, name, classes, devices)]
    subs = _list(first, f"request {name} firstAvailable")
    if not subs:
        raise AllocationError(f"request {name}: firstAvailable is empty")
    out = []
    for j, sub in enumerate(subs):
        sub = _map(sub, f"request {name} subrequest #{j}")
        sub_name = _str(sub.get("name"), f"request {name} subrequest #{j} name")
        out.append(_request(sub, f"{name}/{sub_name}", name, classes, devices))
    return out


def _request(
    raw: Mapping[str, Any],
    name: str,
    base: str,
    classes: Mapping[str, Mapping[str, Any]],
    devices: list[_Device],
) -> _Request:
    what = f"request {name}"
    if raw.get("adminAccess"):
        raise AllocationError(f"{what}: adminAccess is not supported")
    if raw.get("tolerations"):
        raise AllocationError(f"{what}: tolerations are not supported")
    klass = _str(raw.get("deviceClassName"), f"{what} deviceClassName")
    if klass not in classes:
        raise AllocationError(f"{what}: DeviceClass {klass!r} not found")
    class_spec = _map(_map(classes[klass], f"DeviceClass {klass}").get("spec") or {}, klass)
    selectors = _selectors(class_spec.get("selectors"), f"DeviceClass {klass}")
    selectors += _selectors(raw.get("selectors"), what)
    capacity = {
        k: _amount(v, f"{what} capacity {k}")
        for k, v in _map((raw.get("capacity") or {}).get("requests") or {}, what).items()
    }
    mode = raw.get("allocationMode") or EXACT_COUNT
    result = _Request(name, base, 1, mode == ALL, selectors, capacity, klass)
    if mode == ALL:
        if "count" in raw:
            raise AllocationError(f"{what}: count goes with allocationMode ExactCount only")
        result.count = sum(1 for d in devices if _eligible(result, d))
    elif mode == EXACT_COUNT:
        count = raw.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_RESULTS:
            raise AllocationError(f"{what}: count must be 1..{MAX_RESULTS}, got {count!r}")
        result.count = count
    else:
        raise AllocationError(f"{what}: unknown allocationMode {mode!r}")
    return result


def _selectors(raw: object, what: str) -> list[Callable[[Mapping[str, Any]], bool]]:
    out = []
    for i, selector in enumerate(_list(raw, f"{what} selectors")):
        cel = _map(_map(selector, f"{what} selector #{i}").get("cel"), f"{what} selector #{i}")
        try:
            out.append(compile_selector(cel.get("expression")))
        except UnsupportedSelector as exc:
            raise AllocationError(f"{what} selector #{i}: {exc}") from None
    return out


def _constraint(raw: object, index: int) -> tuple[str, str, set[str]]:
    constraint = _map(raw, f"constraint #{index}")
    requests = {
        _str(r, f"constraint #{index} request")
        for r in _list(constraint.get("requests"), "requests")
    }
    for kind in ("matchAttribute", "distinctAttribute"):
        if constraint.get(kind) is not None:
            return kind, _str(constraint[kind], f"constraint #{index} {kind}"), requests
    raise AllocationError(f"constraint #{index}: neither matchAttribute nor distinctAttribute")


def _config(
    spec: Mapping[str, Any], classes: Mapping[str, Mapping[str, Any]], used: list[_Request]
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for klass in dict.fromkeys(r.klass for r in used):
        for entry in _list((classes[klass].get("spec") or {}).get("config"), f"{klass} config"):
            out.append({"source": "FromClass", **_map(entry, f"{klass} config")})
    names = {r.base for r in used} | {r.name for r in used}
    for entry in _list(spec.get("config"), "claim config"):
        entry = _map(entry, "claim config")
        wanted = _list(entry.get("requests"), "claim config requests")
        if not wanted or names & set(wanted):
            out.append({"source": "FromClaim", **entry})
    return out


# ---------------------------------------------------------------- search


def _selectable(request: _Request, device: _Device) -> bool:
    if device.tainted:
        return False
    try:
        return all(selector(device.view) for selector in request.selectors)
    except SelectorError as exc:
        raise AllocationError(
            f"request {request.name}, DeviceClass {request.klass}: selector failed on device "
            f"{device.key[2]}: {exc}"
        ) from None


def _eligible(request: _Request, device: _Device) -> bool:
    """The device passes the selectors and could hold the request were it free."""
    return _selectable(request, device) and _consumption(request, device) is not None


def _consumption(request: _Request, device: _Device) -> Capacity | None:
    """What the request consumes on the device, per capacity; None if it cannot."""
    if any(name not in device.capacity for name in request.capacity):
        return None
    consumed: Capacity = {}
    for name, (value, policy) in device.capacity.items():
        asked = request.capacity.get(name)
        amount = _by_policy(asked, value, policy if device.shared else None)
        if amount is None or amount > value:
            return None
        consumed[name] = amount
    return consumed


def _by_policy(
    asked: Decimal | None, value: Decimal, policy: Mapping[str, Any] | None
) -> Decimal | None:
    if asked is None:
        default = (policy or {}).get("default")
        return value if default is None else _amount(default, "requestPolicy default")
    if policy is None:
        return asked
    valid_range = policy.get("validRange")
    if valid_range is not None and valid_range.get("min") is not None:
        low = _amount(valid_range["min"], "validRange min")
        amount = max(asked, low)
        if valid_range.get("step") is not None:
            step = _amount(valid_range["step"], "validRange step")
            if step > 0:
                steps = ((amount - low) / step).to_integral_value(rounding=ROUND_CEILING)
                amount = low + steps * step
        high = valid_range.get("max")
        return None if high is not None and amount > _amount(high, "validRange max") else amount
    if policy.get("validValues") is not None:
        values = sorted(_amount(v, "validValues") for v in policy["validValues"])
        return next((v for v in values if v >= asked), None)
    return asked


def _fits(request: _Request, device: _Device, state: _State) -> Capacity | bool | None:
    """False if the device cannot take one more device of the request; else what it
    consumes (a dict for a shared device, None for an exclusive one)."""
    if device.key in state.exclusive:
        return False
    if not device.shared and device.key in state.consumed:
        return False
    consumed = _consumption(request, device)
    if consumed is None:
        return False
    if not device.shared:
        return None
    used = state.consumed.get(device.key, {})
    for name, amount in consumed.items():
        if used.get(name, Decimal(0)) + amount > device.capacity[name][0]:
            return False
    return consumed


def _constraints_hold(constraints: list[tuple[str, str, set[str]]], picks: list[_Pick]) -> bool:
    for kind, attribute, requests in constraints:
        values = []
        for pick in picks:
            if requests and pick.request.base not in requests and pick.request.name not in requests:
                continue
            domain, _, name = attribute.rpartition("/")
            raw = pick.device.view["attributes"].get(attribute)
            if raw is None and pick.device.key[0] == domain:
                raw = pick.device.view["attributes"].get(name)
            if raw is None:
                return False
            values.append(repr(sorted(raw.items())) if isinstance(raw, Mapping) else repr(raw))
        if kind == "matchAttribute" and len(set(values)) > 1:
            return False
        if kind == "distinctAttribute" and len(set(values)) != len(values):
            return False
    return True


def _search(
    options: list[list[_Request]],
    index: int,
    slot: int,
    devices: list[_Device],
    state: _State,
    constraints: list[tuple[str, str, set[str]]],
    chosen: _Request | None = None,
) -> bool:
    if index == len(options):
        return True
    if chosen is None:  # a request: its subrequests in order
        return any(
            _search(options, index, 0, devices, state, constraints, option)
            for option in options[index]
            if not option.all_devices or option.count > 0
        )
    if slot == chosen.count:
        return _search(options, index + 1, 0, devices, state, constraints)
    if len(state.picks) >= MAX_RESULTS:
        return False
    if chosen.all_devices:
        candidates = [d for d in devices if _eligible(chosen, d)][slot : slot + 1]
    else:
        candidates = [d for d in devices if _selectable(chosen, d)]
    for device in candidates:
        state.steps += 1
        if state.steps > MAX_STEPS:
            return False
        consumed = _fits(chosen, device, state)
        if consumed is False:
            continue
        pick = _Pick(chosen, device, consumed if isinstance(consumed, dict) else None)
        state.picks.append(pick)
        if not _constraints_hold(constraints, state.picks):
            state.picks.pop()
            continue
        _take(state, pick, +1)
        if _search(options, index, slot + 1, devices, state, constraints, chosen):
            return True
        _take(state, pick, -1)
        state.picks.pop()
    return False


def _take(state: _State, pick: _Pick, sign: int) -> None:
    key = pick.device.key
    if pick.consumed is None:
        (state.exclusive.add if sign > 0 else state.exclusive.discard)(key)
        return
    used = state.consumed.setdefault(key, {})
    for name, amount in pick.consumed.items():
        used[name] = used.get(name, Decimal(0)) + sign * amount
