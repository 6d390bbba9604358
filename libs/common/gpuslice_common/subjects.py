"""Every NATS subject gpuslice uses, built in one place under a configurable prefix.

Node names become subject tokens. Kubernetes node names are RFC 1123 subdomains
(lower-case letters, digits, '-' and '.'); a '.' would split the token, so it is
written as '_', which such names never contain, and the mapping stays reversible.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpuslice_common.events import EventType

_PREFIX = re.compile(r"^[A-Za-z0-9_-]+$")
_NODE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_VERB = re.compile(r"^[a-z][a-z0-9-]{0,31}$")
_UID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def node_token(node: str) -> str:
    """The subject token for a Kubernetes node name."""
    if len(node) > 253 or not _NODE.fullmatch(node):
        raise ValueError(f"not a Kubernetes node name: {node!r}")
    return node.replace(".", "_")


def node_from_token(token: str) -> str:
    return token.replace("_", ".")


def uid_token(uid: str) -> str:
    if not _UID.fullmatch(uid):
        raise ValueError(f"not a pod UID: {uid!r}")
    return uid


@dataclass(frozen=True)
class Subjects:
    prefix: str = "gpuslice"

    def __post_init__(self) -> None:
        if not _PREFIX.fullmatch(self.prefix):
            raise ValueError(f"subject prefix must be one token: {self.prefix!r}")

    # node agent -> inventory
    def inventory(self, node: str) -> str:
        return f"{self.prefix}.inventory.{node_token(node)}"

    @property
    def inventory_all(self) -> str:
        return f"{self.prefix}.inventory.*"

    # node agent -> inventory, request-reply: the node is the subject's, never the payload's
    def node_request(self, node: str, verb: str) -> str:
        """Where a node agent asks the inventory to ``verb`` (allocate, ping, ...)."""
        if not _VERB.fullmatch(verb):
            raise ValueError(f"not a request verb: {verb!r}")
        return f"{self.prefix}.node.{node_token(node)}.{verb}"

    def node_requests(self, node: str) -> str:
        """Every request subject of one node: what that node's credential may publish to."""
        return f"{self.prefix}.node.{node_token(node)}.>"

    @property
    def node_requests_all(self) -> str:
        """What the inventory serves: every node's requests."""
        return f"{self.prefix}.node.*.*"

    def parse_node_request(self, subject: str) -> tuple[str, str] | None:
        """(node, verb) of a request subject, or None when it is not one."""
        parts = subject.split(".")
        if len(parts) != 4 or parts[0] != self.prefix or parts[1] != "node":
            return None
        node = node_from_token(parts[2])
        if len(node) > 253 or not _NODE.fullmatch(node) or not _VERB.fullmatch(parts[3]):
            return None
        return node, parts[3]

    @staticmethod
    def node_inbox(node: str) -> str:
        """Where a node agent takes its replies: only it may subscribe there, and
        the inventory answers a node's request nowhere else."""
        return f"_INBOX.{node_token(node)}"

    # interposer -> inventory
    def telemetry(self, node: str, pod_uid: str) -> str:
        return f"{self.prefix}.telemetry.{node_token(node)}.{uid_token(pod_uid)}"

    def telemetry_node(self, node: str) -> str:
        """What a container credential on this node may publish to."""
        return f"{self.prefix}.telemetry.{node_token(node)}.*"

    @property
    def telemetry_all(self) -> str:
        return f"{self.prefix}.telemetry.*.*"

    # stand-in for the API server (dev stack) -> inventory
    @property
    def pod_ended(self) -> str:
        return f"{self.prefix}.pods.ended"

    # audited events
    def event(self, event_type: EventType) -> str:
        return f"{self.prefix}.events.{event_type.suffix}"

    @property
    def events_all(self) -> str:
        return f"{self.prefix}.events.>"

    @property
    def audit_stream(self) -> str:
        """JetStream stream that captures every event; distinct prefixes never share one."""
        return f"{self.prefix}_audit"
