"""Pods asking for another vendor's cards (read from HAMi's device configuration)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpuslice_common.config import RequestSettings
from gpuslice_common.devicetypes import with_vendors
from tests.webhook.conftest import HIDDEN, applied, check_response, container, pod, review

CONFIG = Path(__file__).parents[1] / "data" / "hami-device-config.yaml"
VENDORS = with_vendors(RequestSettings(), str(CONFIG))
DCU = {"hygon.com/dcunum": 1, "hygon.com/dcumem": 2000}


async def test_a_vendor_pod_goes_to_gpuslices_scheduler_as_it_is(admit: Any) -> None:
    sent = review(pod(container("dcu", DCU), container("log")))
    status, answer = await admit(sent, requests=VENDORS)
    assert status == 200
    response = check_response(sent, answer)
    after = applied(sent["request"]["object"], response)
    assert after["spec"]["schedulerName"] == "gpuslice-scheduler"
    dcu, log = after["spec"]["containers"]
    # the vendor's device plugin reads its resources: nothing NVIDIA's is written
    assert dcu["resources"] == {"limits": DCU}
    # NVIDIA's cards are hidden from it, as from any container not asking for them
    assert dcu["env"] == HIDDEN
    assert log["env"] == HIDDEN


async def test_without_a_device_config_a_vendor_pod_is_left_alone(admit: Any) -> None:
    sent = review(pod(container("dcu", DCU)))
    status, answer = await admit(sent)
    assert status == 200
    response = check_response(sent, answer)
    assert response["allowed"] is True
    assert "patch" not in response


async def test_two_vendors_in_one_container_are_denied(admit: Any) -> None:
    sent = review(pod(container("dcu", {**DCU, "nvidia.com/gpu": 1})))
    status, answer = await admit(sent, requests=VENDORS)
    assert status == 200
    response = check_response(sent, answer)
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert "nvidia (nvidia.com/gpu) and hygon (hygon.com/dcunum)" in message


async def test_a_vendor_container_showing_itself_nvidias_cards_is_denied(admit: Any) -> None:
    # a vendor pod is outside NVIDIA's quotas and limits: on a node that also has
    # NVIDIA's cards, NVIDIA_VISIBLE_DEVICES=all would hand it every one of them
    shown = container("dcu", DCU, env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}])
    sent = review(pod(shown))
    status, answer = await admit(sent, requests=VENDORS)
    assert status == 200
    response = check_response(sent, answer)
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert "container 'dcu'" in message
    assert "NVIDIA_VISIBLE_DEVICES=all" in message
