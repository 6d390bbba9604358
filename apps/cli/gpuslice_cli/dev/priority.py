"""The API server's priority admission, for the local stack's pods.

As kube-apiserver's ``Priority`` admission plugin does before any webhook: a pod
naming a ``priorityClassName`` gets that PriorityClass's value as
``spec.priority`` and its ``preemptionPolicy`` (unless the pod sets one); a pod
naming none gets 0 (this stack has no global default class); a pod naming a
class that does not exist, or giving a ``spec.priority`` other than the one
computed or a ``preemptionPolicy`` other than the class's, is refused. So
``spec.priority`` is never what a pod's author wrote, only what a class an
operator made says: the extender's GPU preemption relies on that.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

PREEMPT_LOWER = "PreemptLowerPriority"


def admit_priority(pod: dict[str, Any], classes: Mapping[str, Mapping[str, Any]]) -> str:
    """Set the pod's ``spec.priority`` and ``spec.preemptionPolicy``; "" when
    admitted, else the refusal."""
    spec = pod.setdefault("spec", {})
    name = spec.get("priorityClassName") or ""
    if not isinstance(name, str):
        return "spec.priorityClassName must be a string"
    value, policy = 0, PREEMPT_LOWER
    if name:
        found = classes.get(name)
        if found is None:
            return f"no PriorityClass with name {name} was found"
        value, policy = int(found["value"]), str(found.get("preemptionPolicy") or PREEMPT_LOWER)
    given = spec.get("priority")
    if given is not None and given != value:
        return (
            f"the integer value of priority ({given}) must not be provided in pod spec; "
            f"priority admission controller computed {value} from the given PriorityClass name"
        )
    own = spec.get("preemptionPolicy")
    if own is not None and own != policy:
        return (
            f"the string value of PreemptionPolicy ({own}) must not be provided in pod spec; "
            f"priority admission controller computed {policy} from the given PriorityClass name"
        )
    spec["priority"] = value
    spec["preemptionPolicy"] = policy
    return ""
