"""HAMi's device configuration read into device types: its defaults, and refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice_common.devicetypes import (
    AnnotationFormat,
    CardSource,
    DeviceConfigError,
    parse_device_config,
)

HAMI_DEFAULT = Path(__file__).parent / "data" / "hami-device-config.yaml"


def test_hami_default_config_gives_every_vendor_its_resources() -> None:
    config = parse_device_config(HAMI_DEFAULT.read_text())
    assert config.warnings == ()
    types = config.by_vendor()
    nvidia = types["nvidia"]
    assert nvidia.resources == (
        "nvidia.com/gpu",
        "nvidia.com/gpumem",
        "nvidia.com/gpumem-percentage",
        "nvidia.com/gpucores",
        "nvidia.com/priority",
    )
    assert (nvidia.split_count, nvidia.default_count, nvidia.memory_factor) == (10, 1, 1)
    assert types["cambricon"].count_resource == "cambricon.com/vmlu"
    assert types["cambricon"].memory_factor == 256  # vmemory counts 256 MiB units
    assert types["mthreads"].memory_factor == 512
    assert types["hygon"].memory_resource == "hygon.com/dcumem"
    assert types["metax-sgpu"].count_resource == "metax-tech.com/sgpu"
    assert types["metax-sgpu"].memory_factor == 1024
    assert types["enflame"].count_resource == "enflame.com/drs-gcu"
    assert types["xpu"].memory_resource == "kunlunxin.com/vxpu-memory"
    assert types["kunlun"].count_resource == "kunlunxin.com/xpu"
    assert types["mr-v100"].count_resource == "iluvatar.ai/MR-V100-vgpu"
    assert types["mr-v100"].memory_factor == 256
    ascend = types["ascend910b3"]
    assert ascend.count_resource == "huawei.com/Ascend910B3"
    assert (ascend.memory_capacity_mib, ascend.ai_cores) == (65536, 20)
    assert [t.name for t in ascend.templates] == ["vir05_1c_16g", "vir10_3c_32g"]
    assert ascend.templates[1].memory_mib == 32768
    assert len(config.types) == 21


def test_announcements_follow_each_vendors_plugin() -> None:
    types = parse_device_config(HAMI_DEFAULT.read_text()).by_vendor()
    hygon = types["hygon"].announcement
    assert hygon is not None
    assert (hygon.register, hygon.handshake, hygon.format) == (
        "hami.io/node-dcu-register",
        "hami.io/node-handshake-dcu",
        AnnotationFormat.COLON,
    )
    ascend = types["ascend910a"].announcement
    assert ascend is not None
    assert ascend.register == "hami.io/node-register-Ascend910A"
    assert ascend.handshake == "hami.io/node-handshake-Ascend910A"
    assert ascend.format is AnnotationFormat.JSON
    iluvatar = types["bi-v150"].announcement
    assert iluvatar is not None
    assert iluvatar.register == "hami.io/node-BI-V150-register"
    assert iluvatar.format is AnnotationFormat.COLON
    amd = types["amd"].announcement
    assert amd is not None
    assert amd.handshake is None
    assert types["vastai"].announcement is not None
    assert types["vastai"].announcement.cores == 100
    # vendors whose cards HAMi derives from node capacity, or reads from the vendor's
    # own annotation: read from there
    sources = {v: types[v].source for v in ("cambricon", "mthreads", "metax", "kunlun")}
    assert set(sources.values()) == {CardSource.CAPACITY}
    assert types["metax-sgpu"].source is CardSource.METAX
    assert types["enflame"].source is CardSource.ENFLAME
    cambricon = types["cambricon"].capacity
    assert cambricon is not None
    assert (cambricon.cores_resource, cambricon.memory_unit) == (
        "cambricon.com/mlu.smlu.vcore",
        256,
    )
    assert not types["awsneuron"].supported
    announced = {t.vendor for t in parse_device_config(HAMI_DEFAULT.read_text()).announced()}
    assert "awsneuron" not in announced
    assert {"hygon", "xpu", "biren", "amd", "ascend910b3"} <= announced
    assert {"cambricon", "mthreads", "metax", "metax-sgpu", "enflame", "kunlun"} <= announced


def test_unknown_section_is_kept_unsupported_never_nvidia() -> None:
    config = parse_device_config("nvidia: {}\nteslaxyz:\n  resourceCountName: x.io/tpu\n")
    assert any("section teslaxyz" in w for w in config.warnings)
    unknown = config.by_vendor()["teslaxyz"]
    assert not unknown.supported
    assert unknown.count_resource is None
    assert unknown.announcement is None
    assert config.by_vendor()["nvidia"].count_resource == "nvidia.com/gpu"


@pytest.mark.parametrize(
    "text",
    [
        "NVIDIA: {}\n",  # an unknown section whose name reads as nvidia
        "nvidia-:\n  resourceCountName: x.io/gpu\n",
        "iluvatars:\n  - {commonWord: NVIDIA, resourceCountName: iluvatar.ai/gpu}\n",
        "vnpus:\n  configs:\n    - {commonWord: Nvidia, resourceName: h.com/a, "
        "resourceMemoryName: h.com/m, templates: [{name: v, memory: 1, aiCore: 1}]}\n",
    ],
)
def test_no_other_section_can_name_the_vendor_nvidia(text: str) -> None:
    """Such a type took NVIDIA's place: the defaults were not added and NVIDIA's
    own cards and resources were no longer known as NVIDIA's."""
    with pytest.raises(DeviceConfigError, match="only the nvidia section names vendor 'nvidia'"):
        parse_device_config(text)


def test_missing_nvidia_section_means_hami_defaults() -> None:
    config = parse_device_config("hygon:\n  resourceCountName: hygon.com/dcunum\n")
    assert config.by_vendor()["nvidia"].memory_resource == "nvidia.com/gpumem"


def test_unknown_key_in_known_section_is_a_warning() -> None:
    config = parse_device_config("hygon:\n  resourceCountName: h.com/d\n  colour: red\n")
    assert config.warnings == ("device config: hygon.colour is not a known setting; ignored",)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("nvidia:\n  deviceSplitCount: 0\n", "nvidia.deviceSplitCount is 0"),
        ("nvidia:\n  deviceSplitCount: 99999\n", "nvidia.deviceSplitCount is 99999"),
        ("nvidia:\n  deviceSplitCount: ten\n", "nvidia.deviceSplitCount is 'ten'"),
        ("nvidia:\n  deviceMemoryScaling: -1\n", "nvidia.deviceMemoryScaling is -1"),
        ("nvidia:\n  deviceMemoryScaling: .nan\n", "nvidia.deviceMemoryScaling is nan"),
        ("nvidia:\n  defaultCores: 101\n", "nvidia.defaultCores is 101"),
        ("nvidia:\n  defaultMemory: true\n", "nvidia.defaultMemory is True"),
        ("nvidia:\n  resourceCountName: 'bad name'\n", "nvidia.resourceCountName"),
        ("nvidia:\n  enableNumaTopology: maybe\n", "nvidia.enableNumaTopology"),
        ("hygon:\n  memoryFactor: 0\n", "hygon.memoryFactor is 0"),
        # digits of other scripts pass str.isdigit() and not int()
        ("hygon:\n  memoryFactor: '\u00b2'\n", "hygon.memoryFactor is '\u00b2', not a whole"),
        (
            "vnpus:\n  configs:\n"
            "    - {commonWord: A, resourceName: h.com/a, templates: [{memory: 1}]}\n",
            "vnpus.configs[0].templates[0].name is missing",
        ),
        ("hygon:\n  resourceMemoryName: h.com/m\n", "hygon.resourceCountName is missing"),
        ("hygon: [1, 2]\n", "hygon is not a mapping"),
        ("iluvatars:\n  - resourceCountName: i.ai/x\n", "iluvatars[0].commonWord is missing"),
        (
            "vnpus:\n  configs:\n"
            "    - {commonWord: A, resourceName: h.com/a, templates: [{name: v}]}\n",
            "vnpus.configs[0].templates[0].memory is missing",
        ),
        ("- a\n- b\n", "not a mapping of vendor sections"),
        ("nvidia: {\n", "not valid YAML"),
        (
            "hygon:\n  resourceCountName: nvidia.com/gpu\n",
            "resource nvidia.com/gpu is named by both",
        ),
        (
            "iluvatars:\n  - {commonWord: X, resourceCountName: a.io/x}\n"
            "  - {commonWord: x, resourceCountName: a.io/y}\n",
            "names vendor 'x' again",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_key(text: str, named: str) -> None:
    with pytest.raises(DeviceConfigError) as caught:
        parse_device_config(text)
    assert named in str(caught.value)


def test_huge_config_is_refused_before_parsing() -> None:
    with pytest.raises(DeviceConfigError, match="bytes, above the bound"):
        parse_device_config("#" * (2 * 1024 * 1024))


def test_yaml_tags_are_not_executed() -> None:
    with pytest.raises(DeviceConfigError, match="not valid YAML"):
        parse_device_config("nvidia: !!python/object/apply:os.system ['true']\n")
