"""The kube-scheduler extender wire format (k8s.io/kube-scheduler/extender/v1).

The Go types carry no JSON tags, so kube-scheduler sends Go field names
(``Pod``, ``NodeNames``, ``Nodes``, ``PodUID``) and reads replies
case-insensitively. Requests are read here with keys in any case; replies are
written in Go casing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

MAX_NODES = 100_000


class WireError(ValueError):
    """A request that is not what kube-scheduler sends; the message says what is wrong."""


def _fold(value: object, what: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise WireError(f"{what} must be a JSON object, got {type(value).__name__}")
    return {str(k).lower(): v for k, v in value.items()}


def decode(body: bytes, what: str) -> dict[str, Any]:
    """Parse a request body into a dict with lower-cased top-level keys."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise WireError(f"{what}: body is not valid JSON ({exc})") from None
    return _fold(value, what)


def _pod(args: Mapping[str, Any], what: str) -> dict[str, Any]:
    pod = args.get("pod")
    if pod is None:
        raise WireError(f"{what}: missing Pod")
    if not isinstance(pod, Mapping):
        raise WireError(f"{what}: Pod must be an object")
    return dict(pod)


def _names(value: object, what: str) -> list[str]:
    if not isinstance(value, list) or not set(map(type, value)) <= {str} or "" in value:
        raise WireError(f"{what} must be a list of node names")
    if len(value) > MAX_NODES:
        raise WireError(f"{what} lists {len(value)} nodes, more than {MAX_NODES}")
    return list(value)


@dataclass
class ExtenderArgs:
    """Filter and prioritize input: the pod and the candidate nodes."""

    pod: dict[str, Any]
    node_names: list[str]
    nodes: dict[str, Any] | None  # the NodeList when nodeCacheCapable is false

    @classmethod
    def parse(cls, body: bytes, verb: str) -> ExtenderArgs:
        args = decode(body, verb)
        pod = _pod(args, verb)
        names = args.get("nodenames")
        nodes = args.get("nodes")
        if names is not None:
            return cls(pod, _names(names, f"{verb}: NodeNames"), None)
        if nodes is None:
            return cls(pod, [], None)  # both null: zero nodes fit
        if not isinstance(nodes, Mapping):
            raise WireError(f"{verb}: Nodes must be a NodeList object")
        items = nodes.get("items") or []
        if not isinstance(items, list):
            raise WireError(f"{verb}: Nodes.items must be a list")
        found = []
        for i, item in enumerate(items):
            meta = item.get("metadata") if isinstance(item, Mapping) else None
            name = meta.get("name") if isinstance(meta, Mapping) else None
            if not isinstance(name, str) or not name:
                raise WireError(f"{verb}: Nodes.items[{i}] has no metadata.name")
            found.append(name)
        return cls(pod, _names(found, f"{verb}: Nodes"), dict(nodes))

    def filter_reply(
        self, passed: list[str], failed: dict[str, str], unresolvable: dict[str, str]
    ) -> dict[str, Any]:
        """ExtenderFilterResult in the same form the nodes came in."""
        reply: dict[str, Any] = {
            "FailedNodes": failed,
            "FailedAndUnresolvableNodes": unresolvable,
            "Error": "",
        }
        if self.nodes is None:
            reply["NodeNames"] = passed
            reply["Nodes"] = None
        else:
            keep = set(passed)
            items = [i for i in self.nodes.get("items") or [] if i["metadata"]["name"] in keep]
            reply["Nodes"] = {**self.nodes, "items": items}
            reply["NodeNames"] = None
        return reply


def filter_error(message: str) -> dict[str, Any]:
    return {
        "Nodes": None,
        "NodeNames": None,
        "FailedNodes": {},
        "FailedAndUnresolvableNodes": {},
        "Error": message,
    }


@dataclass
class BindingArgs:
    pod_name: str
    pod_namespace: str
    pod_uid: str
    node: str

    @classmethod
    def parse(cls, body: bytes) -> BindingArgs:
        args = decode(body, "bind")
        values = {}
        for key, go in (
            ("podname", "PodName"),
            ("podnamespace", "PodNamespace"),
            ("poduid", "PodUID"),
            ("node", "Node"),
        ):
            value = args.get(key)
            if not isinstance(value, str) or not value:
                raise WireError(f"bind: {go} must be a non-empty string")
            values[key] = value
        return cls(values["podname"], values["podnamespace"], values["poduid"], values["node"])


@dataclass
class PreemptionArgs:
    pod: dict[str, Any]
    victims: dict[str, dict[str, Any]]  # node -> MetaVictims

    @classmethod
    def parse(cls, body: bytes) -> PreemptionArgs:
        args = decode(body, "preempt")
        pod = _pod(args, "preempt")
        source = args.get("nodenametometavictims")
        what = "NodeNameToMetaVictims"
        if source is None:
            source, what = args.get("nodenametovictims"), "NodeNameToVictims"
        if source is None:
            source = {}
        if not isinstance(source, Mapping):
            raise WireError(f"preempt: {what} must be an object")
        victims = {str(node): _meta_victims(v, str(node)) for node, v in source.items()}
        return cls(pod, victims)


def _meta_victims(value: object, node: str) -> dict[str, Any]:
    victims = _fold(value, f"preempt: victims of {node}")
    pods = victims.get("pods") or []
    if not isinstance(pods, list):
        raise WireError(f"preempt: victims of {node}: Pods must be a list")
    uids = []
    for pod in pods:
        folded = _fold(pod, f"preempt: a victim on {node}")
        uid = folded.get("uid")
        if uid is None:  # a full v1.Pod: the UID is in metadata
            meta = folded.get("metadata")
            uid = meta.get("uid") if isinstance(meta, Mapping) else None
        if not isinstance(uid, str) or not uid:
            raise WireError(f"preempt: a victim on {node} has no UID")
        uids.append({"UID": uid})
    violations = victims.get("numpdbviolations", 0)
    if not isinstance(violations, int) or isinstance(violations, bool) or violations < 0:
        raise WireError(f"preempt: NumPDBViolations of {node} must be a non-negative integer")
    return {"Pods": uids, "NumPDBViolations": violations}
