"""The webhook's plain-HTTP metrics port, over real HTTP: Prometheus text on
GET /metrics, and every other request refused with a one-line answer."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuslice_common.servers import free_port
from gpuslice_webhook.metrics import Metrics
from gpuslice_webhook.service import running
from tests.rawhttp import post_huge
from tests.webhook.conftest import CORES, GPU, MEM, V1, container, pod, review, settings


async def test_metrics_are_served_on_their_own_plain_port(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    config = settings(listen_port=free_port())
    async with (
        running(config, None, None) as state,
        httpx.AsyncClient(timeout=5) as client,
    ):
        assert state.metrics_port == config.metrics_port != state.port
        sent = review(pod(container("c", {GPU: 1, MEM: 1000, CORES: 30})))
        answer = await client.post(f"http://127.0.0.1:{state.port}/mutate", json=sent)
        assert answer.json()["response"]["allowed"] is True
        base = f"http://127.0.0.1:{state.metrics_port}"
        scraped = await client.get(f"{base}/metrics")
        assert scraped.status_code == 200
        assert scraped.headers["content-type"].startswith("text/plain; version=0.0.4")
        families = {f.name: f for f in text_string_to_metric_families(scraped.text)}
        admitted = [
            s.value
            for s in families["gpuslice_webhook_admissions"].samples
            if s.name.endswith("_total") and s.labels == {"outcome": "admitted"}
        ]
        assert admitted == [1.0]
        for name in ("events_dropped", "tls_reloads", "tls_reload_failures"):
            assert families[f"gpuslice_webhook_{name}"].type == "counter"
        assert (await client.get(f"{base}/healthz")).json() == {"status": "ok"}

        # the admission paths are not on this port, nor any other path
        for path in ("/mutate", "/readyz", "/openapi.json", "/metrics/x", "/metrics/hami/x"):
            refused = await client.get(f"{base}{path}")
            assert refused.status_code == 404
            assert "only /metrics, /metrics/hami and /healthz" in refused.json()["error"]
        wrong = await client.post(f"{base}/metrics")
        assert wrong.status_code == 405
        assert wrong.headers["allow"] == "GET, HEAD"
        # a body is refused before it is read, declared or chunked
        for chunked in (False, True):
            status, body, _ = await asyncio.to_thread(
                post_huge, state.metrics_port, "/metrics", 4096, chunked=chunked
            )
            assert status == 413
            assert "larger than 0 bytes" in json.loads(body)["error"]
        mutate = review(pod(container("c", {GPU: 1})), version=V1)
        sneaked = await client.post(f"{base}/mutate", json=mutate)
        assert sneaked.status_code == 413
        # serving goes on
        assert (await client.get(f"{base}/metrics")).status_code == 200
    assert "Traceback" not in caplog.text
    assert not any(r.exc_info for r in caplog.records)


async def test_a_taken_metrics_port_stops_the_start_with_an_os_error() -> None:
    config = settings(listen_port=free_port())
    async with running(config, None, None) as state:
        clash = settings(listen_port=free_port(), metrics_port=state.metrics_port)
        with pytest.raises(OSError, match=f"cannot serve HTTP on 127.0.0.1:{state.metrics_port}"):
            async with running(clash, None, None):
                pass


@pytest.mark.parametrize("hami", [True, False])
def test_quota_use_has_gpuslice_s_name_and_hami_s_apart_while_the_setting_is_on(
    hami: bool,
) -> None:
    metrics = Metrics(hami=hami)
    metrics.quota("team", "gpu", "limits.nvidia.com/gpumem", 3000, 20000)
    text = generate_latest(metrics.registry).decode()
    labels = 'namespace="team",quota="gpu",resource="nvidia.com/gpumem"'
    assert f"gpuslice_quota_used{{{labels}}} 3000.0" in text
    assert f"gpuslice_quota_limit{{{labels}}} 20000.0" in text
    assert "QuotaUsed" not in text  # camelCase: on /metrics/hami only
    render = metrics.render_hami()
    assert (render is not None) is hami
    if render is not None:
        hami_line = (
            'QuotaUsed{limit="20000",quotaName="nvidia.com/gpumem",quotanamespace="team",'
            'zone="vGPU"} 3000.0'
        )
        assert hami_line in render().decode()


@pytest.mark.parametrize("hami", [True, False])
async def test_hami_s_names_are_on_metrics_hami_of_both_ports_while_the_setting_is_on(
    hami: bool,
) -> None:
    config = settings(listen_port=free_port(), hami_metrics=hami)
    async with (
        running(config, None, None) as state,
        httpx.AsyncClient(timeout=5) as client,
    ):
        state.admission.metrics.quota("team", "gpu", "limits.nvidia.com/gpumem", 3000, 20000)
        for port in (state.metrics_port, state.port):
            answer = await client.get(f"http://127.0.0.1:{port}/metrics/hami")
            if hami:
                assert answer.status_code == 200
                assert answer.headers["content-type"].startswith("text/plain; version=0.0.4")
                names = {f.name for f in text_string_to_metric_families(answer.text)}
                assert names == {"QuotaUsed"}
            else:
                assert answer.status_code == 404
                assert answer.json() == {
                    "error": "HAMi's metric names are off: GPUSLICE_HAMI_METRICS is false"
                }
            posted = await client.post(f"http://127.0.0.1:{port}/metrics/hami")
            assert posted.status_code == 405
            plain = await client.get(f"http://127.0.0.1:{port}/metrics")
            assert "QuotaUsed" not in plain.text
            assert "gpuslice_quota_used{" in plain.text


def test_a_changed_quota_limit_replaces_hami_s_series_rather_than_adding_one() -> None:
    """HAMi's QuotaUsed carries the limit as a label: the series of the old limit goes."""
    metrics = Metrics(hami=True)
    metrics.quota("team", "gpu", "limits.nvidia.com/gpumem", 1000, 20000)
    metrics.quota("team", "gpu", "limits.nvidia.com/gpumem", 3000, 30000)
    metrics.quota("other", "gpu", "limits.nvidia.com/gpumem", 5, 20000)
    assert metrics.hami_registry is not None
    series = [
        (s.labels["quotanamespace"], s.labels["limit"], s.value)
        for family in metrics.hami_registry.collect()
        for s in family.samples
    ]
    assert sorted(series) == [("other", "20000", 5), ("team", "30000", 3000)]
