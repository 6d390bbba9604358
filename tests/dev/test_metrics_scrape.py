"""Every service scraped as Prometheus would: the local stack with a pod
running, each process's plain-HTTP metrics port read over HTTP on ``/metrics``
and ``/metrics/hami``, each ``/metrics`` body passing ``promtool check metrics``
(HAMi's camelCase names, which it flags, are on ``/metrics/hami`` alone), each
series name exported by one kind of service with one label set, and every
query of the Grafana dashboard naming only series some service exports."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gpuslice_cli.dev.driver import ClusterDriver
from gpuslice_cli.dev.stack import Stack
from gpuslice_common.bus import Bus
from gpuslice_common.ledger import Ledger
from tests.dev.test_stack import gpu_pod

DASHBOARD = Path(__file__).resolve().parents[2] / "k8s/grafana-dashboard.json"
CONTAINER_LABELS = {"node", "namespace", "pod", "pod_uid", "container", "uuid"}
GPU_LABELS = {"node", "uuid", "index", "model", "vendor"}
# PromQL words that look like series names
PROMQL = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
    "and", "or", "unless", "sum", "max", "min", "avg", "count", "rate", "increase",
    "histogram_quantile", "vector", "le", "topk", "bottomk", "irate", "delta", "abs",
}  # fmt: skip
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
PATHS = ("/metrics", "/metrics/hami")
Scraped = dict[tuple[str, str], str]  # (process, path) -> body


def kind_of(name: str, stack: Stack) -> str:
    """The service a process of the stack runs."""
    if name in {n.name for n in stack.nodes}:
        return "deviceplugin"
    return "scheduler" if name.startswith("scheduler") else name.rstrip("-0123456789")


def promtool(body: str) -> tuple[int, list[str]]:
    """``promtool check metrics`` on ``body``: its exit code and the problems it
    finds (3: lint problems only)."""
    checked = subprocess.run(
        ["promtool", "check", "metrics"], input=body, capture_output=True, text=True, check=False
    )
    problems = [line for line in (checked.stdout + checked.stderr).splitlines() if line.strip()]
    return checked.returncode, problems


def queried_names(expr: str) -> set[str]:
    """The series names a PromQL expression reads (label values, label names in
    ``by (...)`` and ranges left out)."""
    bare = re.sub(r'"[^"]*"', '""', expr)  # label values
    bare = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", bare)
    bare = re.sub(r"\{[^}]*\}", "", bare)  # matchers
    bare = re.sub(r"\[[^\]]*\]", "", bare)  # ranges
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", bare))
    return {w for w in words if w not in PROMQL and not w.startswith("$")}


async def scrape_until(stack: Stack, ready: Any, timeout: float = 60) -> Scraped:
    """Every process's metrics on both paths, once ``ready(bodies)`` holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with httpx.AsyncClient(timeout=5) as client:
        while True:
            bodies = {}
            for name, url in stack.metrics_urls.items():
                for path in PATHS:
                    answer = await client.get(url.removesuffix("/metrics") + path)
                    assert answer.status_code == 200, (name, path, answer.text)
                    assert answer.headers["content-type"].startswith("text/plain"), (name, path)
                    bodies[name, path] = answer.text
            if ready(bodies):
                return bodies
            assert loop.time() < deadline, "the series never appeared"
            await asyncio.sleep(0.5)


async def test_every_service_is_scraped_and_the_dashboard_reads_only_exported_series(
    up: tuple[Stack, ClusterDriver, Bus, Ledger],
) -> None:
    assert shutil.which("promtool"), "promtool is missing: `make promtool` installs it"
    stack, driver, _, _ = up
    stack.kube.add_resource_quota(
        "team",
        {"metadata": {"name": "gpu"}, "spec": {"hard": {"limits.nvidia.com/gpumem": "20000"}}},
    )
    busy = gpu_pod("busy", ["probe", "init", "ctx", "alloc", "1g", "sleep", "30000"], mem=8000)
    quoted = gpu_pod("quoted", ["probe", "init"], mem=3000)
    running = asyncio.create_task(driver.run_pod(busy))
    quota_outcome = await driver.run_pod(quoted, namespace="team")
    assert quota_outcome.phase == "Succeeded", quota_outcome.reason

    def labelled(bodies: Scraped) -> bool:
        text = "\n".join(bodies.values())
        return (
            "gpuslice_container_memory_used_bytes{" in text
            and 'pod="busy"' in text
            # the inventory's HAMi names, from the ledger
            and re.search(r'^vGPUMemoryAllocated\{[^}]*podname="busy"', text, re.M) is not None
            and "gpuslice_gpu_memory_capacity_mib{" in text
            and "QuotaUsed{" in text
        )

    try:
        bodies = await scrape_until(stack, labelled)
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    kinds = {kind_of(name, stack) for name, _ in bodies}
    assert kinds == {"webhook", "scheduler", "inventory", "deviceplugin"}

    # promtool: /metrics passes; /metrics/hami holds HAMi's names, flagged only
    # for being camelCase, as HAMi writes them
    flagged: set[str] = set()
    for (name, path), body in bodies.items():
        code, problems = promtool(body)
        if path == "/metrics":
            assert (code, problems) == (0, []), (name, problems)
            continue
        assert code in (0, 3), (name, problems)
        for problem in problems:
            assert "camelCase" in problem, (name, problem)
            flagged.add(problem.split()[0])
    hami_names = {
        family.name
        for (name, path), body in bodies.items()
        if path == "/metrics/hami"
        for family in text_string_to_metric_families(body)
    }
    assert {"GPUDeviceMemoryAllocated", "QuotaUsed", "HostGPUMemoryUsage"} <= hami_names
    assert {"GPUDeviceMemoryAllocated", "QuotaUsed"} <= flagged
    assert not [n for n in hami_names if n.startswith(("gpuslice_", "hami_"))], hami_names

    # one name, one label set, one kind of service; counters as counters
    owners: dict[str, set[str]] = defaultdict(set)
    label_sets: dict[str, set[frozenset[str]]] = defaultdict(set)
    exported: set[str] = set()
    samples: dict[str, list[Any]] = defaultdict(list)
    for (name, _), body in bodies.items():
        for family in text_string_to_metric_families(body):
            owners[family.name].add(kind_of(name, stack))
            if family.type == "gauge":
                assert not family.name.endswith("_total"), family.name
            if family.type == "counter":
                exported.add(f"{family.name}_total")
            elif family.type == "histogram":
                exported |= {family.name + s for s in HISTOGRAM_SUFFIXES}
            else:
                exported.add(family.name)
            for sample in family.samples:
                if family.type == "histogram" and not sample.name.endswith("_bucket"):
                    keys = frozenset(sample.labels)
                else:
                    keys = frozenset(sample.labels) - {"le"}
                label_sets[sample.name].add(keys)
                samples[sample.name].append(sample)
    shared = {name: kinds for name, kinds in owners.items() if len(kinds) > 1}
    assert not shared, shared
    mixed = {name: sets for name, sets in label_sets.items() if len(sets) > 1}
    assert not mixed, mixed
    for name in ("gpuslice_container_memory_used_bytes", "gpuslice_container_sm_percent"):
        assert owners[name] <= {"deviceplugin", "inventory"}
    assert owners["gpuslice_container_memory_used_bytes"] == {"deviceplugin"}
    for name, sets in label_sets.items():
        if name.startswith("gpuslice_container_"):
            assert sets == {frozenset(CONTAINER_LABELS)}, name
        if name.startswith("gpuslice_gpu_") and owners[name] == {"inventory"}:
            assert sets == {frozenset(GPU_LABELS)}, name
    used = [s for s in samples["gpuslice_container_memory_used_bytes"] if s.labels["pod"] == "busy"]
    assert used
    assert used[0].labels["namespace"] == "default"
    assert used[0].labels["pod_uid"] != "busy"
    memory = [s for s in samples["vGPUMemoryAllocated"] if s.labels["podname"] == "busy"]
    assert [s.value for s in memory] == [8000 * 2**20]
    assert memory[0].labels["podnamespace"] == "default"
    quota = {s.labels["resource"]: s.value for s in samples["gpuslice_quota_used"]}
    assert quota == {"nvidia.com/gpumem": 3000.0}
    limit = [
        s.labels["limit"] for s in samples["QuotaUsed"] if s.labels["quotanamespace"] == "team"
    ]
    assert limit == ["20000"]

    # the dashboard reads only what is exported
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    variables = [
        v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"
    ]
    wanted = set()
    for expr in exprs:
        wanted |= queried_names(expr)
    for query in variables:
        wanted |= set(re.findall(r"label_values\((\w+)", query))
    assert {
        "gpuslice_webhook_admissions_total",
        "gpuslice_scheduler_request_seconds_bucket",
    } <= wanted
    missing = sorted(wanted - exported)
    assert not missing, missing
    # ... and only gpuslice's names: HAMi's are for HAMi's own dashboards
    assert not [name for name in wanted if not name.startswith("gpuslice_")], wanted
    # ... and by the labels it names: containers by namespace, pod and container
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            assert "pod_uid" not in target.get("legendFormat", ""), panel["title"]
