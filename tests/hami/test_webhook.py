"""HAMi's admission cases against gpuslice's webhook mutation.

The pod goes through :class:`Mutator` as the webhook's handler sends it; the
patch is applied with jsonpatch (an independent RFC 6902 implementation) and
the named parts of the patched pod are compared. Cases with a ``quota`` then
go through the namespace quota check admission makes.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import pytest

from gpuslice_common.config import RequestSettings
from gpuslice_common.models import PodGpuRequest
from gpuslice_webhook import quota
from gpuslice_webhook.mutation import Denied, Mutator
from tests.hami.cases import RESOURCE_PREFIX, Case, params, pod_manifest, request_settings
from tests.webhook.conftest import settings as webhook_settings


def _limit_key(key: str) -> str:
    return key if "/" in key else RESOURCE_PREFIX + key


def _check_quota(case: Case, request: PodGpuRequest, settings: RequestSettings) -> None:
    """The namespace quota check admission makes: the case's ``quota`` gives each
    limit (``memory`` MiB, ``cores`` percent) and what the namespace already uses."""
    spec = case.data["quota"]
    names = settings.resources
    hard = {
        f"{quota.PREFIX}{name}": spec[key]
        for key, name in (("memory", names.memory), ("cores", names.cores))
        if key in spec
    }
    limits = quota.gpu_limits([{"metadata": {"name": "gpu"}, "spec": {"hard": hard}}], settings)
    used = quota.Demand(spec.get("used_memory", 0), spec.get("used_cores", 0))
    quota.check(limits, quota.request_demand(request.containers), used, "default")


def _admit(case: Case) -> tuple[dict[str, Any] | None, str | None]:
    """The pod after admission (None: left unchanged as a pod without GPUs), or the
    refusal's message."""
    options: dict[str, Any] = dict(case.data.get("webhook") or {})
    config = webhook_settings(requests=request_settings(case.data.get("settings")), **options)
    pod = pod_manifest(case.data["pod"])
    try:
        mutation = Mutator(config).mutate(copy.deepcopy(pod), "default")
        if mutation is not None and "quota" in case.data:
            _check_quota(case, mutation.request, config.requests)
    except Denied as denied:
        return None, denied.message
    if mutation is None:
        return None, None
    patched: dict[str, Any] = jsonpatch.apply_patch(pod, mutation.patch.operations)
    return patched, None


@pytest.mark.parametrize("case", params("mutate"))
def test_hami_admission_case(case: Case) -> None:
    outcome = case.outcome
    assert "pending" not in outcome, f"{case.source}: gpuslice has no pending outcome to assert"
    patched, refusal = _admit(case)
    if "denied" in outcome:
        assert refusal is not None, f"{case.source}: admitted, expected a refusal"
        assert outcome["denied"] in refusal, f"{case.source}: {refusal}"
        return
    assert refusal is None, f"{case.source}: refused: {refusal}"
    if outcome.get("unchanged") is True:
        assert patched is None, f"{case.source}: changed"
        return
    assert patched is not None, f"{case.source}: left alone as a pod without GPUs"
    spec = patched["spec"]
    by_name = {c["name"]: c for c in [*spec.get("initContainers", ()), *spec["containers"]]}
    for name, parts in (outcome.get("containers") or {}).items():
        container = by_name[name]
        resources = container.get("resources", {})
        for part in ("limits", "requests"):
            for key, value in (parts.get(part) or {}).items():
                got = resources.get(part, {}).get(_limit_key(key))
                got = None if got is None else str(got)
                wanted = None if value is None else str(value)
                assert got == wanted, f"{case.source}: {name} {part} {key} is {got!r}"
        env = {var["name"]: var.get("value") for var in container.get("env", ())}
        for key, value in (parts.get("env") or {}).items():
            assert env.get(key) == value, f"{case.source}: {name} env {key} is {env.get(key)!r}"
    if "scheduler_name" in outcome:
        assert spec.get("schedulerName") == outcome["scheduler_name"], case.source
