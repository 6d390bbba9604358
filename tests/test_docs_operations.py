"""The operator's pages quote what the code really says: each log line, reason
and command fragment quoted in docs/troubleshooting.md (and the other operator
pages) must still be in the source, or the page leads operators to grep for
nothing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from gpuslice_common.config import (
    DevicePluginSettings,
    InventorySettings,
    SchedulerSettings,
    WebhookSettings,
)

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("libs", "services", "apps", "native/src")

# fragment quoted by the page -> the pages that quote it
QUOTED = {
    "sent no heartbeat for": ["troubleshooting.md"],
    "waiting for the audit stream": ["troubleshooting.md"],
    "the audit stream is there": ["troubleshooting.md"],
    "keeping the current certificate": ["troubleshooting.md"],
    "serving plain HTTP (the API server needs HTTPS)": ["troubleshooting.md"],
    "auth callout: refused a client from": ["troubleshooting.md"],
    "auth callout: cannot answer": ["troubleshooting.md"],
    "registration with kubelet failed": ["troubleshooting.md"],
    "waiting for kubelet's socket": ["troubleshooting.md"],
    "is in MIG mode and migStrategy is none: left out": [
        "troubleshooting.md",
        "migrating-from-hami.md",
    ],
    "cannot make the container's MIG instance": ["troubleshooting.md"],
    "unhealthy until restart": ["troubleshooting.md"],
    "(is the MPS control daemon running?)": ["troubleshooting.md", "hami.md"],
    "node configuration not reloaded; keeping the last good one": ["troubleshooting.md"],
    "inventory not published": ["troubleshooting.md"],
    "NATS still unreachable": ["troubleshooting.md"],
    "cannot sync the scheduler's copy of the ledger": ["troubleshooting.md"],
    "ledger reachable again; the scheduler's copy is in sync": ["troubleshooting.md"],
    "is rebuilt: it takes reservations": ["troubleshooting.md"],
    "reconciliation leaves node": ["troubleshooting.md"],
    "left out of the metrics": ["troubleshooting.md"],
    "every GPU allocation of this process is refused": ["troubleshooting.md"],
    "bytes in use": ["troubleshooting.md"],
    "CardNotFound: no GPU of this node is registered with gpuslice": ["troubleshooting.md"],
    "NodeLedgerRebuilding": ["troubleshooting.md"],
    "cannot read audit stream": ["troubleshooting.md"],
    "webhook listening on": ["troubleshooting.md"],
    "took the lease": ["troubleshooting.md"],
    "refused to stream the current state in a watch": ["troubleshooting.md"],
    "Watches from now list first": ["troubleshooting.md"],
    "pod watch failed (again in": ["troubleshooting.md"],
    "says the API server; pod": ["troubleshooting.md"],
    "holding cards: ": ["troubleshooting.md"],
    "holder_checks": ["troubleshooting.md", "architecture.md"],
    "holders_freed": ["troubleshooting.md", "architecture.md"],
    "pod_watch_listed_first": ["troubleshooting.md", "architecture.md"],
    "gpuslice-audit-init": ["troubleshooting.md", "upgrade.md"],
    "gpuslice-scheduler-writes-placements-only": ["uninstall.md"],
    "gpuslice-placements-by-the-scheduler-only": ["uninstall.md", "install.md"],
    "gpuslice-hami-node-by-the-scheduler-only": ["uninstall.md", "install.md"],
}


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@pytest.fixture(scope="module")
def source() -> str:
    parts = []
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in {".py", ".c", ".h"}:
                parts.append(path.read_text(errors="replace"))
    for path in sorted((ROOT / "k8s").rglob("*.yaml")):
        parts.append(path.read_text())
    return "\n".join(parts)


@pytest.mark.parametrize("fragment", sorted(QUOTED))
def test_quoted_fragment_is_on_its_pages_and_in_the_source(fragment: str, source: str) -> None:
    for page in QUOTED[fragment]:
        assert fragment in _flat((ROOT / "docs" / page).read_text()), f"{page} no longer quotes it"
    assert fragment in source, f"no source says {fragment!r} any more: update docs/"


@pytest.mark.parametrize(
    "page", ["troubleshooting.md", "upgrade.md", "uninstall.md", "migrating-from-hami.md"]
)
def test_operator_pages_are_linked_from_the_readme_and_link_to_what_exists(page: str) -> None:
    readme = (ROOT / "README.md").read_text()
    assert f"(docs/{page})" in readme
    text = (ROOT / "docs" / page).read_text()
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (ROOT / "docs" / target).resolve().exists(), f"{page} links to missing {target}"


def _is_setting(model: type[BaseModel], path: list[str]) -> bool:
    field = model.model_fields.get(path[0])
    if field is None:
        return False
    if len(path) == 1:
        return True
    inner = field.annotation
    return isinstance(inner, type) and issubclass(inner, BaseModel) and _is_setting(inner, path[1:])


def test_every_setting_the_migration_page_names_is_a_setting() -> None:
    text = (ROOT / "docs" / "migrating-from-hami.md").read_text()
    variables = set(re.findall(r"GPUSLICE_[A-Z_]+", text))
    assert "GPUSLICE_REQUESTS__DEFAULTS__GPU_COUNT" in variables
    services = (WebhookSettings, SchedulerSettings, InventorySettings, DevicePluginSettings)
    for variable in sorted(variables):
        path = variable.removeprefix("GPUSLICE_").lower().split("__")
        assert any(_is_setting(m, path) for m in services), f"{variable} is no service's setting"


def test_the_setting_check_refuses_what_is_not_one() -> None:
    assert _is_setting(WebhookSettings, ["requests", "defaults", "memory_mib"])
    assert not _is_setting(WebhookSettings, ["requests", "defaults", "memory"])
    assert not _is_setting(WebhookSettings, ["scheduler_name", "x"])
