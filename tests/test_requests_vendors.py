"""Other vendors' requests, read with the vendors of HAMi's default device configuration."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpuslice_common.config import RequestSettings, VendorResources
from gpuslice_common.devicetypes import DeviceConfigError, with_vendors
from gpuslice_common.models import DrsDemand, MemoryRequest
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


def one(limits: dict[str, Any], annotations: dict[str, str] | None = None) -> Any:
    spec = pod(limits)
    if annotations is not None:
        spec["metadata"]["annotations"] = annotations
    request = parse_pod(spec, SETTINGS)
    assert request is not None
    [container] = request.containers
    return container


def test_ascend_memory_is_rounded_up_to_its_vnpu_templates() -> None:
    # HAMi's documented pod: 16000 MiB of a 910B3 is its 16 GiB template
    c = one({"huawei.com/Ascend910B3": 1, "huawei.com/Ascend910B3-memory": 16000})
    assert (c.vendor, c.count, c.memory, c.cores) == (
        "ascend910b3",
        1,
        MemoryRequest(mib=16384),
        0,
    )
    assert one({"huawei.com/Ascend910B3": 1, "huawei.com/Ascend910B3-memory": 16385}).memory == (
        MemoryRequest(mib=32768)
    )
    # above every template, within the card: the whole card's allocatable memory
    c = one({"huawei.com/Ascend310P": 1, "huawei.com/Ascend310P-memory": 20000})
    assert c.memory == MemoryRequest(mib=21527)
    # no memory: the whole card; several cards are whole cards
    assert one({"huawei.com/Ascend910B3": 2}).memory == MemoryRequest(mib=65536)
    c = one({"huawei.com/Ascend910B3": 2, "huawei.com/Ascend910B3-memory": 65536})
    assert (c.count, c.memory) == (2, MemoryRequest(mib=65536))


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
            {"huawei.com/Ascend910B3": 1, "huawei.com/Ascend910B3-memory": 70000},
            {},
            "huawei.com/Ascend910B3-memory 70000 is more than a card holds (memoryCapacity 65536",
        ),
        (
            {"huawei.com/Ascend910B3": 2, "huawei.com/Ascend910B3-memory": 16000},
            {},
            "several cards are whole cards only",
        ),
        (
            {"huawei.com/Ascend910B3": 1, "huawei.com/Ascend910B3-core": 5},
            {},
            "huawei.com/Ascend910B3-core needs HAMi's hami-core vNPU mode",
        ),
        (
            {"huawei.com/Ascend910B3": 1},
            {"huawei.com/vnpu-mode": "hami-core"},
            "hami-core vNPUs are not placed by gpuslice",
        ),
        (
            {"cambricon.com/vmlu": 2, "cambricon.com/mlu.smlu.vmemory": 8},
            {},
            "a container gets one MLU",
        ),
        (
            {"mthreads.com/vgpu": 1, "mthreads.com/sgpu-memory": 3},
            {},
            "mthreads.com/sgpu-memory 3 is not a Moore Threads sGPU size; "
            "valid values are 2, 4, 8, 16, 32, 64, 96",
        ),
        (
            {"mthreads.com/vgpu": 1, "mthreads.com/sgpu-memory": 4, "mthreads.com/sgpu-core": 17},
            {},
            "mthreads.com/sgpu-core must be between 0 and 16",
        ),
        ({"kunlunxin.com/xpu": 3}, {}, "kunlunxin.com/xpu must be 1, 2, 4 or 8"),
        ({"enflame.com/drs-gcu": 0}, {}, "enflame.com/drs-gcu must be greater than 0"),
        ({"enflame.com/gcu-core": 101}, {}, "enflame.com/gcu-core must be between 0 and 100"),
        ({"enflame.com/gcu-core": 0}, {}, "enflame.com/gcu-core must be in 1..100"),
        (
            {"metax-tech.com/sgpu": 1},
            {"metax-tech.com/sgpu-qos-policy": "greedy"},
            "metax-tech.com/sgpu-qos-policy must be one of best-effort, fixed-share, burst-share",
        ),
        (
            {"metax-tech.com/sgpu": 1},
            {"metax-tech.com/sgpu-app-class": "online"},
            "the online class is not placed by gpuslice",
        ),
    ],
)
def test_each_vendors_own_rules_refuse_what_its_plugin_cannot_serve(
    limits: dict[str, Any], annotations: dict[str, str], message: str
) -> None:
    spec = pod(limits)
    spec["metadata"]["annotations"] = annotations
    with pytest.raises(RequestError) as err:
        parse_pod(spec, SETTINGS)
    assert message in str(err.value)


def test_cambricon_moore_threads_metax_and_kunlun_read_as_hami_reads_them() -> None:
    # HAMi's documented Cambricon pod: memory in 256 MiB units, cores as given
    c = one(
        {
            "cambricon.com/vmlu": 1,
            "cambricon.com/mlu.smlu.vmemory": 8000,
            "cambricon.com/mlu.smlu.vcore": 50,
        }
    )
    assert (c.vendor, c.memory, c.cores) == ("cambricon", MemoryRequest(mib=8000 * 256), 50)
    # cores unset: the card alone (HAMi's 100)
    assert one({"cambricon.com/vmlu": 1}).cores == 100
    # Moore Threads: 512 MiB units, cores in sixteenths, unset 0
    c = one({"mthreads.com/vgpu": 1, "mthreads.com/sgpu-memory": 32, "mthreads.com/sgpu-core": 8})
    assert (c.memory, c.cores) == (MemoryRequest(mib=16384), 8)
    assert one({"mthreads.com/vgpu": 1, "mthreads.com/sgpu-memory": 4}).cores == 0
    # several cards, or no memory: whole cards (all 16 cores)
    c = one({"mthreads.com/vgpu": 2})
    assert (c.count, c.memory, c.cores) == (2, MemoryRequest(percent=100), 16)
    # Metax sGPU: GiB, or bytes with a unit
    c = one({"metax-tech.com/sgpu": 1, "metax-tech.com/vcore": 60, "metax-tech.com/vmemory": 4})
    assert (c.vendor, c.memory, c.cores) == ("metax-sgpu", MemoryRequest(mib=4096), 60)
    assert one({"metax-tech.com/sgpu": 1, "metax-tech.com/vmemory": "2Gi"}).memory == (
        MemoryRequest(mib=2048)
    )
    assert one({"metax-tech.com/sgpu": 1}).cores == 100
    # whole Metax GPUs and Kunlun XPUs
    c = one({"metax-tech.com/gpu": 1})
    assert (c.vendor, c.memory, c.cores) == ("metax", MemoryRequest(percent=100), 100)
    c = one({"kunlunxin.com/xpu": 4})
    assert (c.vendor, c.count, c.exclusive) == ("kunlun", 4, True)


def test_enflame_asks_for_a_drs_profile_one_card_per_container() -> None:
    c = one({"enflame.com/drs-gcu": 3})
    assert (c.vendor, c.count, c.drs) == ("enflame", 1, DrsDemand(size=3))
    c = one({"enflame.com/gcu-memory": 20480, "enflame.com/gcu-core": 40})
    assert c.drs == DrsDemand(memory=20480, cores=40)
    # the JSON of a request without DRS is as before
    assert "drs" not in one({"hygon.com/dcunum": 1}).model_dump()


def test_one_container_per_pod_where_the_vendors_plugin_reads_one_choice() -> None:
    for limits in (
        {"mthreads.com/vgpu": 1},
        {"kunlunxin.com/xpu": 1},
        {"enflame.com/drs-gcu": 1},
        {"cambricon.com/vmlu": 1},
        {"metax-tech.com/gpu": 1},
    ):
        with pytest.raises(RequestError, match="its device plugin reads one choice of cards"):
            parse_pod(pod(limits, limits), SETTINGS)
    # Metax sGPU and HAMi's own encoding name each container's cards
    request = parse_pod(pod({"metax-tech.com/sgpu": 1}, {"metax-tech.com/sgpu": 1}), SETTINGS)
    assert request is not None
    assert len(request.containers) == 2


def test_a_vendor_pod_reads_its_vendors_card_selectors_never_nvidias() -> None:
    spec = pod({"cambricon.com/vmlu": 1})
    spec["metadata"]["annotations"] = {
        "cambricon.com/use-gpuuuid": "n1-cambricon-mlu-0, n1-cambricon-mlu-1",
        "cambricon.com/nouse-mlutype": "MLU370",
        "nvidia.com/use-gpuuuid": "GPU-x",
    }
    request = parse_pod(spec, SETTINGS)
    assert request is not None
    selector = request.selector
    assert selector.include_uuids == ("n1-cambricon-mlu-0", "n1-cambricon-mlu-1")
    assert selector.exclude_types == ("MLU370",)
    # gpuslice's own key applies to every vendor and wins
    spec["metadata"]["annotations"]["gpuslice.io/use-gpuuuid"] = "n1-cambricon-mlu-2"
    request = parse_pod(spec, SETTINGS)
    assert request is not None
    assert request.selector.include_uuids == ("n1-cambricon-mlu-2",)
    # whole Kunlun XPUs: both of HAMi's keys must name a card
    spec = pod({"kunlunxin.com/xpu": 1})
    spec["metadata"]["annotations"] = {
        "baidu.com/use-gpuuuid": "a,b",
        "hami.io/use-xpu-uuid": "b,c",
        "hami.io/no-use-xpu-uuid": "d",
        "baidu.com/nouse-gpuuuid": "e",
    }
    request = parse_pod(spec, SETTINGS)
    assert request is not None
    assert request.selector.include_uuids == ("b",)
    assert set(request.selector.exclude_uuids) == {"d", "e"}
    spec["metadata"]["annotations"]["hami.io/use-xpu-uuid"] = "c"
    request = parse_pod(spec, SETTINGS)
    assert request is not None
    assert request.selector.include_uuids  # lists sharing no card leave none: never empty
    assert not {"a", "b", "c"} & set(request.selector.include_uuids)


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
