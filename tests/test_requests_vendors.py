"""Other vendors' requests, read with the vendors of HAMi's default device configuration."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpuslice_common.config import RequestSettings, VendorResources
from gpuslice_common.devicetypes import DeviceConfigError, with_vendors
from gpuslice_common.models import MemoryRequest
from gpuslice_common.requests import RequestError, asks_for_gpus, has_gpu_request, parse_pod

CONFIG = Path(__file__).parent / "data" / "hami-device-config.yaml"
SETTINGS = with_vendors(RequestSettings(), str(CONFIG))


def pod(*limits: dict[str, Any], init: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [
            {"name": f"c{i}", "resources": {"limits": lim}} for i, lim in enumerate(limits)
        ]
    }
    if init is not None:
        spec["initContainers"] = [{"name": "i0", "resources": {"limits": init}}]
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "u1"}, "spec": spec}


def test_the_default_config_gives_the_vendors_gpuslice_registers() -> None:
    vendors = {v.vendor: v for v in SETTINGS.vendors}
    assert vendors["hygon"] == VendorResources(
        vendor="hygon",
        count="hygon.com/dcunum",
        memory="hygon.com/dcumem",
        cores="hygon.com/dcucores",
        memory_factor=1,
        device_type="DCU",
        allocate_key="dcu",
        use_type="hygon.com/use-dcutype",
        nouse_type="hygon.com/nouse-dcutype",
        use_uuid=("hygon.com/use-gpuuuid",),
        nouse_uuid=("hygon.com/nouse-gpuuuid",),
    )
    assert vendors["mr-v100"].memory_factor == 256
    # the words of the annotations HAMi's plugins read at Allocate
    keys = {v.vendor: (v.device_type, v.allocate_key) for v in SETTINGS.vendors}
    assert keys["mr-v100"] == ("MR-V100", "MR-V100")
    assert keys["xpu"] == ("XPU", "xpu")
    assert keys["amd"] == ("AMD", "amd")
    assert keys["biren"] == ("Biren", "Biren")
    assert keys["vastai"] == ("Vastai", "Vastai")
    assert {"amd", "xpu", "biren", "vastai"} <= set(vendors)
    assert keys["cambricon"] == ("MLU", "cambricon-mlu")
    assert keys["mthreads"] == ("Mthreads", "mthreads-vgpu")
    assert keys["metax-sgpu"] == ("Metax-SGPU", "metax-sgpu")
    assert keys["ascend910b3"] == ("Ascend910B3", "Ascend910B3")
    assert "nvidia" not in vendors
    assert "awsneuron" not in vendors


def test_a_vendor_container_gets_its_vendor_factor_and_defaults() -> None:
    request = parse_pod(
        pod(
            {"hygon.com/dcunum": 2, "hygon.com/dcumem": "3000", "hygon.com/dcucores": 30},
            {"cpu": "1"},
        ),
        SETTINGS,
    )
    assert request is not None
    [c] = request.containers
    assert (c.vendor, c.count, c.memory, c.cores) == ("hygon", 2, MemoryRequest(mib=3000), 30)
    assert request.vendor == "hygon"
    # Iluvatar counts memory in 256 MiB units; cores unset are 100, memory unset the whole card
    request = parse_pod(
        pod({"iluvatar.ai/MR-V100-vgpu": 1, "iluvatar.ai/MR-V100.vMem": 4}), SETTINGS
    )
    assert request is not None
    [c] = request.containers
    assert (c.vendor, c.memory, c.cores) == ("mr-v100", MemoryRequest(mib=1024), 100)
    request = parse_pod(pod({"birentech.com/gpu": 1}), SETTINGS)
    assert request is not None
    [c] = request.containers
    assert (c.vendor, c.memory, c.cores, c.exclusive) == (
        "biren",
        MemoryRequest(percent=100),
        100,
        True,
    )


def test_nvidia_stays_as_it_is_with_or_without_a_device_config() -> None:
    spec = pod({"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1000})
    with_config, without = parse_pod(spec, SETTINGS), parse_pod(spec)
    assert with_config == without
    assert with_config is not None
    assert with_config.vendor == "nvidia"
    # without a device config another vendor's resource is no GPU request
    hygon = pod({"hygon.com/dcunum": 1})
    assert parse_pod(hygon) is None
    assert not has_gpu_request(hygon)
    assert not asks_for_gpus(hygon)
    assert has_gpu_request(hygon, SETTINGS)
    assert asks_for_gpus(hygon, SETTINGS)


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        (
            {"hygon.com/dcunum": 1, "nvidia.com/gpu": 1},
            "container 'c0': asks for nvidia (nvidia.com/gpu) and hygon (hygon.com/dcunum) cards",
        ),
        (
            {"hygon.com/dcunum": 1, "amd.com/gpumem": 10},
            "container 'c0': asks for hygon (hygon.com/dcunum) and amd (amd.com/gpumem) cards",
        ),
        ({"hygon.com/dcumem": 100}, "hygon.com/dcunum is not set but hygon.com/dcumem is set"),
        ({"hygon.com/dcunum": 0, "hygon.com/dcucores": 5}, "hygon.com/dcunum is 0 but"),
        ({"hygon.com/dcunum": 65}, "hygon.com/dcunum must be between 0 and 64"),
        ({"hygon.com/dcunum": 1, "hygon.com/dcucores": 101}, "must be between 0 and 100"),
        ({"hygon.com/dcunum": "1.5"}, "hygon.com/dcunum must be a whole number"),
        ({"hygon.com/dcunum": -1}, "must not be negative"),
        # memory units times the factor stay within the MiB bound
        ({"iluvatar.ai/MR-V100-vgpu": 1, "iluvatar.ai/MR-V100.vMem": 2**31}, "between 0 and"),
    ],
)
def test_bad_vendor_requests_are_refused(limits: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestError) as err:
        parse_pod(pod(limits), SETTINGS)
    assert message in str(err.value)


def test_a_pod_uses_one_vendors_cards() -> None:
    with pytest.raises(
        RequestError,
        match="container 'c0' asks for hygon cards and container 'c1' for nvidia cards",
    ):
        parse_pod(pod({"hygon.com/dcunum": 1}, {"nvidia.com/gpu": 1}), SETTINGS)
    with pytest.raises(RequestError, match="'i0' asks for amd cards"):
        parse_pod(pod({"hygon.com/dcunum": 1}, init={"amd.com/gpu": 1}), SETTINGS)
    # a count of 0 alone asks for nothing, whatever the vendor
    request = parse_pod(pod({"hygon.com/dcunum": 1}, {"nvidia.com/gpu": 0}), SETTINGS)
    assert request is not None
    assert [c.name for c in request.containers] == ["c0"]


def test_a_device_config_that_renames_nvidias_resources_onto_a_vendor_is_refused(
    tmp_path: Path,
) -> None:
    path = tmp_path / "device-config.yaml"
    # the config's own NVIDIA section is renamed; gpuslice's NVIDIA resource names are not
    path.write_text(
        "nvidia:\n  resourceCountName: x.com/gpu\nhygon:\n  resourceCountName: nvidia.com/gpu\n"
    )
    with pytest.raises(DeviceConfigError, match=r"nvidia\.com/gpu is both nvidia.s and hygon.s"):
        with_vendors(RequestSettings(), str(path))
    assert with_vendors(RequestSettings(), "") == RequestSettings()


def test_moore_threads_whole_cards_read_the_same_as_hamis_webhook_writes_them() -> None:
    whole = MemoryRequest(percent=100)
    for limits in (
        {"mthreads.com/vgpu": 1},
        {"mthreads.com/vgpu": 1, "mthreads.com/sgpu-memory": 96, "mthreads.com/sgpu-core": 16},
    ):
        request = parse_pod(pod(limits), SETTINGS)
        assert request is not None
        [c] = request.containers
        assert (c.count, c.memory, c.cores) == (1, whole, 16)
    # two cards as the webhook states them: the count's total, no warning
    written = {
        "mthreads.com/vgpu": 2,
        "mthreads.com/sgpu-memory": 192,
        "mthreads.com/sgpu-core": 32,
    }
    request = parse_pod(pod(written), SETTINGS)
    assert request is not None
    assert request.warnings == ()
    assert (request.containers[0].memory, request.containers[0].cores) == (whole, 16)
    # an sGPU of a card's memory and fewer cores stays an sGPU
    request = parse_pod(
        pod({"mthreads.com/vgpu": 1, "mthreads.com/sgpu-memory": 96, "mthreads.com/sgpu-core": 8}),
        SETTINGS,
    )
    assert request is not None
    assert request.containers[0].memory == MemoryRequest(mib=96 * 512)
    other = {"mthreads.com/vgpu": 2, "mthreads.com/sgpu-core": 8}
    request = parse_pod(pod(other), SETTINGS)
    assert request is not None
    assert request.warnings == (
        "container 'c0': mthreads.com/vgpu 2 takes whole cards; its memory and cores are "
        "set to the whole card's, as HAMi's webhook does",
    )


@pytest.mark.parametrize(
    ("limits", "annotations", "message"),
    [
        (
            {"mthreads.com/vgpu": 1, "mthreads.com/sgpu-memory": 8, "mthreads.com/sgpu-core": 17},
            {},
            "container 'c0': mthreads.com/sgpu-core must be between 0 and 16, got 17",
        ),
        (
            {"mthreads.com/vgpu": 2, "mthreads.com/sgpu-core": 33},
            {},
            "container 'c0': mthreads.com/sgpu-core must be between 0 and 32, got 33",
        ),
        (
            {"mthreads.com/vgpu": 2},
            {"mthreads.com/request-gpu-num": "4"},
            "annotation mthreads.com/request-gpu-num says '4' but the pod asks for 2",
        ),
    ],
)
def test_moore_threads_cores_and_card_count_beyond_the_request_are_refused(
    limits: dict[str, Any], annotations: dict[str, str], message: str
) -> None:
    asked = pod(limits)
    asked["metadata"]["annotations"] = annotations
    with pytest.raises(RequestError) as err:
        parse_pod(asked, SETTINGS)
    assert message in str(err.value)
