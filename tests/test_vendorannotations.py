"""What bind writes on a pod for each vendor family's device plugin, checked against
the exact strings HAMi's scheduler writes (its ``PatchAnnotations`` per vendor)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpuslice_common import drs
from gpuslice_common.config import VendorResources
from gpuslice_common.devicetypes import Rules, parse_device_config, vendor_requests
from gpuslice_common.models import ContainerAssignment, DeviceGrant, Placement, PodRef
from gpuslice_scheduler.cluster import CardFacts
from gpuslice_scheduler.vendorannotations import (
    FAMILIES,
    EncodingError,
    encode_devices,
    vendor_annotations,
)

CONFIG = Path(__file__).parent / "data" / "hami-device-config.yaml"
VENDORS = vendor_requests(parse_device_config(CONFIG.read_text()))
BY_NAME = {v.vendor: v for v in VENDORS}
NOW_NS = 1_700_000_000_123_456_789
COMMON = {
    "hami.io/vgpu-node": "n1",
    "hami.io/bind-time": "1700000000",
    "hami.io/bind-phase": "allocating",
}
# DRS profiles of 1, 2 and 4 slices (25%, 50%, 100% of a card)
TABLE = drs.table([drs.profile("1g.8gb", "10"), drs.profile("2g.16gb", "11"),
                   drs.profile("4g.32gb", "12")])  # fmt: skip
CARDS = {
    "c-a": CardFacts(5, "MLU"),
    "c-b": CardFacts(2, "MLU"),
    "c-c": CardFacts(7, "MLU"),
    "g-a": CardFacts(3, drs.model_of(TABLE, "9")),
    "g-b": CardFacts(1, drs.model_of(TABLE, "4")),
}


def spec(*names: str, init: tuple[str, ...] = ("setup",)) -> dict[str, Any]:
    """A pod with init containers ``init`` and app containers ``names``."""
    return {
        "metadata": {"name": "p", "namespace": "team"},
        "spec": {
            "initContainers": [{"name": n} for n in init],
            "containers": [{"name": n} for n in names],
        },
    }


def grant(uuid: str, memory: int, cores: int) -> DeviceGrant:
    return DeviceGrant(uuid=uuid, memory_mib=memory, cores=cores)


def placed(vendor: str, **containers: tuple[DeviceGrant, ...]) -> Placement:
    return Placement(
        pod=PodRef(uid="u"),
        node="n1",
        containers=tuple(
            ContainerAssignment(name=name, devices=grants, vendor=vendor)
            for name, grants in containers.items()
        ),
    )


def written(pod: dict[str, Any], placement: Placement) -> dict[str, str]:
    return vendor_annotations(pod, placement, VENDORS, CARDS, NOW_NS)


def test_every_family_has_a_writer() -> None:
    assert set(FAMILIES) == set(Rules)
    assert {Rules(v.rules) for v in VENDORS} == set(Rules)


def test_hami_s_common_form() -> None:
    pod = spec("main", "log")
    got = written(pod, placed("hygon", main=(grant("DCU-a", 2000, 30), grant("DCU-b", 10, 0))))
    encoded = ";DCU-a,DCU,2000,30:DCU-b,DCU,10,0:;;"
    assert got == COMMON | {
        "hami.io/dcu-devices-to-allocate": encoded,
        "hami.io/dcu-devices-allocated": encoded,
    }


def test_ascend_names_each_card_s_vnpu_template() -> None:
    pod = spec("main", "log")
    # 910A's templates: vir02 2184, vir04 4369, vir08 8738, vir16 17476 MiB
    placement = placed(
        "ascend910a",
        setup=(grant("NPU-a", 3000, 4),),
        main=(grant("NPU-b", 32768, 0),),  # a whole card: no template
    )
    got = written(pod, placement)
    encoded = "NPU-a,Ascend910A,3000,4:;NPU-b,Ascend910A,32768,0:;;"
    assert got == COMMON | {
        "hami.io/Ascend910A-devices-to-allocate": encoded,
        "hami.io/Ascend910A-devices-allocated": encoded,
        "predicate-time": "1700000000",
        "huawei.com/Ascend910A": '[{"UUID":"NPU-a","temp":"vir04","memory":3000,"core":4},'
        '{"UUID":"NPU-b","memory":32768}]',
    }
    # the smallest template that holds it, at its exact size too
    exact = written(pod, placed("ascend910a", main=(grant("NPU-a", 2184, 2),)))
    assert json.loads(exact["huawei.com/Ascend910A"]) == [
        {"UUID": "NPU-a", "temp": "vir02", "memory": 2184, "core": 2}
    ]


def test_ascend_templates_are_tried_smallest_first_whatever_their_order() -> None:
    vendor = BY_NAME["ascend910a"]
    shuffled = vendor.model_copy(update={"templates": tuple(reversed(vendor.templates))})
    placement = placed("ascend910a", main=(grant("NPU-a", 100, 0),))
    got = vendor_annotations(spec("main"), placement, (shuffled,), CARDS, NOW_NS)
    assert got["huawei.com/Ascend910A"] == '[{"UUID":"NPU-a","temp":"vir02","memory":100}]'


def test_cambricon_names_the_first_card_s_profile() -> None:
    pod = spec("main", "log")
    placement = placed("cambricon", main=(grant("c-a", 1000, 30),), log=(grant("c-b", 512, 10),))
    got = written(pod, placement)
    encoded = ";c-a,MLU,1000,30:;c-b,MLU,512,10:;"
    assert got == COMMON | {
        "hami.io/cambricon-mlu-devices-to-allocate": encoded,
        "hami.io/cambricon-mlu-devices-allocated": encoded,
        "CAMBRICON_DSMLU_ASSIGNED": "false",
        # card index 5, 30 cores, 1000 MiB in units of 256 MiB (rounded down)
        "CAMBRICON_DSMLU_PROFILE": "5_30_3",
    }


def test_mthreads_names_the_last_container_s_card_indexes() -> None:
    pod = spec("main", "log")
    placement = placed(
        "mthreads",
        setup=(grant("c-b", 1024, 4),),
        main=(grant("c-a", 49152, 16), grant("c-c", 49152, 16)),
    )
    got = written(pod, placement)
    assert got == COMMON | {
        "hami.io/mthreads-vgpu-devices-allocated": (
            "c-b,Mthreads,1024,4:;c-a,Mthreads,49152,16:c-c,Mthreads,49152,16:;;"
        ),
        "mthreads.com/gpu-index": "5,7",
        "mthreads.com/predicate-time": "1700000000123456789",
        "mthreads.com/predicate-node": "n1",
    }


def test_metax_whole_cards_get_hami_s_form_only() -> None:
    got = written(spec("main", init=()), placed("metax", main=(grant("M-a", 65536, 100),)))
    encoded = "M-a,Metax-GPU,65536,100:;"
    assert got == COMMON | {
        "hami.io/metax-gpu-devices-to-allocate": encoded,
        "hami.io/metax-gpu-devices-allocated": encoded,
    }


def test_metax_sgpus_list_every_container() -> None:
    pod = spec("main", "log")
    placement = placed(
        "metax-sgpu",
        main=(grant("M-a", 4096, 30), grant("M-b", 2048, 0)),
        log=(grant("M-c", 0, 5),),
    )
    got = written(pod, placement)
    encoded = ";M-a,Metax-SGPU,4096,30:M-b,Metax-SGPU,2048,0:;M-c,Metax-SGPU,0,5:;"
    assert got == COMMON | {
        "hami.io/metax-sgpu-devices-to-allocate": encoded,
        "hami.io/metax-sgpu-devices-allocated": encoded,
        # one list per container, the init container's empty; zeros left out
        "metax-tech.com/gpu-devices-allocated": '[[],[{"uuid":"M-a","compute":30,"vRam":4096},'
        '{"uuid":"M-b","vRam":2048}],[{"uuid":"M-c","compute":5}]]',
        "metax-tech.com/predicate-time": "1700000000123456789",
    }


def test_enflame_names_each_container_s_drs_profile() -> None:
    pod = spec("worker", "aux", init=())
    placement = placed(
        "enflame",
        worker=(grant("g-a", 16384, 50),),  # 2g.16gb
        aux=(grant("g-b", 8192, 25),),  # 1g.8gb
    )
    got = written(pod, placement)
    assert got == COMMON | {
        "hami.io/enflame-vgpu-devices-allocated": ("g-a,Enflame,16384,50:;g-b,Enflame,8192,25:;"),
        "enflame.com/gcu-assigned": "false",
        "enflame.com/gcu-assigned-time": "1700000000123456789",
        # a map: Go writes its keys sorted
        "assigned-containers": '{"aux":{"allocated":false,"request":1,"profileID":"10",'
        '"profileName":"1g.8gb"},"worker":{"allocated":false,"request":2,"profileID":"11",'
        '"profileName":"2g.16gb"}}',
        # the first container with cards: "worker", on card g-a (index 3, minor 9)
        "enflame.com/gcu-assigned-index": "3",
        "enflame.com/gcu-assigned-id": "3",
        "enflame.com/gcu-assigned-minor": "9",
        "enflame.com/gcu-request-size": "2",
    }


def test_kunlun_names_the_card_indexes() -> None:
    pod = spec("main", init=())
    got = written(pod, placed("kunlun", main=(grant("c-b", 98304, 100), grant("c-a", 98304, 100))))
    assert got == COMMON | {
        "hami.io/kunlun-allocated": "c-b,kunlun,98304,100:c-a,kunlun,98304,100:;",
        "BAIDU_COM_DEVICE_IDX": "2,5",
    }


def test_a_pod_on_nvidia_cards_gets_nothing() -> None:
    nvidia = Placement(
        pod=PodRef(uid="u"),
        node="n1",
        containers=(ContainerAssignment(name="main", devices=(grant("GPU-a", 1, 1),)),),
    )
    assert written(spec("main"), nvidia) == {}


@pytest.mark.parametrize(
    ("vendor", "grants", "message"),
    [
        # the card's index is read in the scheduler's copy of the node
        ("kunlun", (grant("gone", 98304, 100),), "'gone' is not among node n1's cards"),
        ("mthreads", (grant("gone", 1024, 4),), "'gone' is not among node n1's cards"),
        ("cambricon", (grant("gone", 256, 10),), "'gone' is not among node n1's cards"),
        ("enflame", (grant("gone", 8192, 25),), "'gone' is not among node n1's cards"),
        # no profile of the card is 8 GB with half the card's compute
        ("enflame", (grant("g-a", 8192, 50),), "'g-a' on node n1 has no DRS profile of 8192"),
        # an MLU's model lists no DRS profile
        ("enflame", (grant("c-a", 8192, 25),), "'c-a' on node n1 has no DRS profile"),
        ("hygon", (grant("DCU,a", 1, 1),), "cannot be written for HAMi"),
        ("metax-sgpu", (grant("M;a", 1, 1),), "cannot be written for HAMi"),
        ("ascend910a", (grant("N:a", 1, 1),), "cannot be written for HAMi"),
    ],
)
def test_what_cannot_be_written_fails_the_bind(
    vendor: str, grants: tuple[DeviceGrant, ...], message: str
) -> None:
    with pytest.raises(EncodingError, match=message):
        written(spec("main"), placed(vendor, main=grants))


def test_a_vendor_or_family_the_scheduler_does_not_know_fails_the_bind() -> None:
    placement = placed("hygon", main=(grant("DCU-a", 1, 1),))
    with pytest.raises(EncodingError, match="vendor hygon is not in the scheduler's device"):
        vendor_annotations(spec("main"), placement, (), CARDS, NOW_NS)
    odd = BY_NAME["hygon"].model_copy(update={"rules": "odd"})
    with pytest.raises(EncodingError, match="rules 'odd' name no family"):
        vendor_annotations(spec("main"), placement, (odd,), CARDS, NOW_NS)


def test_encode_devices_is_hami_s_encoding() -> None:
    hygon: VendorResources = BY_NAME["hygon"]
    placement = placed("hygon", main=(grant("DCU-a", 1, 1),))
    assert encode_devices(spec("main", "log"), placement, hygon) == ";DCU-a,DCU,1,1:;;"
    with pytest.raises(EncodingError, match="'main' is not in the pod's spec"):
        encode_devices(spec("other"), placement, hygon)
