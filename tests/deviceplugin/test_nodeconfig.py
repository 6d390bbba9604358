"""The per-node configuration file: defaults, per-node overrides, HAMi's key spellings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuslice_common.models import GpuDevice, VgpuMode
from gpuslice_deviceplugin.nodeconfig import (
    MPS_PIPE_DIRECTORY,
    MPS_SHM_DIRECTORY,
    FilterDevices,
    MpsDaemon,
    NodeConfig,
    NodeConfigError,
    SimulatedGpus,
    load_node_config,
    parse_node_config,
)

FULL = """
defaults:
  deviceSplitCount: 6
  deviceMemoryScaling: 1.25
  deviceCoreScaling: 2
  filterDevices: {uuid: [GPU-aaa], index: [3]}
  operatingMode: hami-core
  libCudaLogLevel: 3
  gpuCorePolicy: force
  contextOverhead: 384
  simulate: {count: 2, model: NVIDIA L4, memoryMiB: 23034, numaNodes: 2, unhealthy: [1]}
nodeconfig:
  - name: gpu-node-1
    devicememoryscaling: 1.5
    filterdevices: {index: [0]}
  - name: gpu-node-2
    devicesplitcount: 20
"""


def problems(text: str, node: str = "n") -> list[str]:
    with pytest.raises(NodeConfigError) as info:
        parse_node_config(text, node, source="nodes.yaml")
    lines = str(info.value).splitlines()
    assert all(line.startswith("nodes.yaml: ") for line in lines), lines
    assert list(info.value.problems) == [line.removeprefix("nodes.yaml: ") for line in lines]
    return list(info.value.problems)


def gpu(index: int, uuid: str = "") -> GpuDevice:
    return GpuDevice(uuid=uuid or f"GPU-{index}", index=index, model="m", memory_mib=1024)


# ------------------------------------------------------------------------ values


def test_no_file_and_an_empty_file_give_the_defaults(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_node_config(None, "n") == NodeConfig()
    assert load_node_config(empty, "n") == NodeConfig()
    assert parse_node_config("defaults:\nnodeconfig:\n", "n") == NodeConfig()
    default = NodeConfig()
    assert (default.split_count, default.memory_scaling, default.core_scaling) == (10, 1.0, 1.0)
    assert (default.log_level, default.core_policy, default.context_overhead_mib) == (
        2,
        "default",
        None,
    )
    assert default.simulate == SimulatedGpus(count=4, memory_mib=81920)


def test_defaults_apply_to_a_node_without_an_entry() -> None:
    config = parse_node_config(FULL, "other-node")
    assert config == NodeConfig(
        split_count=6,
        memory_scaling=1.25,
        core_scaling=2.0,
        filter_devices=FilterDevices(uuids=("GPU-aaa",), indices=(3,)),
        log_level=3,
        core_policy="force",
        context_overhead_mib=384,
        simulate=SimulatedGpus(
            count=2, model="NVIDIA L4", memory_mib=23034, numa_nodes=2, unhealthy=(1,)
        ),
    )


def test_a_node_entry_overrides_key_by_key() -> None:
    one = parse_node_config(FULL, "gpu-node-1")
    assert one.memory_scaling == 1.5
    assert (one.split_count, one.core_policy, one.context_overhead_mib) == (6, "force", 384)
    # a nested object replaces the defaults' one whole: the uuid filter is gone
    assert one.filter_devices == FilterDevices(indices=(0,))
    two = parse_node_config(FULL, "gpu-node-2")
    assert (two.split_count, two.memory_scaling) == (20, 1.25)
    assert two.filter_devices == FilterDevices(uuids=("GPU-aaa",), indices=(3,))


def test_a_node_simulate_section_replaces_the_defaults_one() -> None:
    text = """
defaults: {simulate: {count: 3, model: NVIDIA T4, unhealthy: [2]}}
nodeconfig: [{name: n, simulate: {count: 2}}]
"""
    assert parse_node_config(text, "n").simulate == SimulatedGpus(count=2)
    assert parse_node_config(text, "m").simulate == SimulatedGpus(
        count=3, model="NVIDIA T4", unhealthy=(2,)
    )


def test_mps_mode_with_nvidia_s_directories_by_default() -> None:
    config = parse_node_config("defaults: {operatingmode: mps}", "n")
    assert (config.operating_mode, config.mode) == ("mps", VgpuMode.MPS)
    assert config.mps == MpsDaemon(
        pipe_directory="/run/nvidia/mps/nvidia.com/gpu/pipe",
        shm_directory="/run/nvidia/mps/shm",
        writable_pipe=False,
    )
    assert MpsDaemon() == MpsDaemon(
        pipe_directory=MPS_PIPE_DIRECTORY, shm_directory=MPS_SHM_DIRECTORY
    )
    assert NodeConfig().mode is VgpuMode.HAMI_CORE


def test_one_node_in_mps_mode_with_its_own_daemon_directories() -> None:
    text = """
defaults:
  mps: {pipeDirectory: /run/mps/pipe}
nodeconfig:
  - name: mps-node
    operatingMode: mps
    mps:
      pipe_directory: /var/run/mps-a/pipe
      shm-directory: /var/run/mps-a/shm
      writablePipe: true
"""
    node = parse_node_config(text, "mps-node")
    assert node.mode is VgpuMode.MPS
    assert node.mps == MpsDaemon(
        pipe_directory="/var/run/mps-a/pipe", shm_directory="/var/run/mps-a/shm", writable_pipe=True
    )
    writable = "defaults: {mps: {shmDirectory: /run/m, pipeDirectory: /run/m/p, writablePipe: 1}}"
    assert parse_node_config(writable, "n").mps.pipe_directory == "/run/m/p"
    other = parse_node_config(text, "other")
    assert other.mode is VgpuMode.HAMI_CORE
    assert other.mps == MpsDaemon(pipe_directory="/run/mps/pipe")
    assert problems("defaults: {mps: {pipe: /run/p}}") == ["defaults: unknown key 'mps.pipe'"]


@pytest.mark.parametrize(
    "key",
    [
        "devicesplitcount",
        "deviceSplitCount",
        "device_split_count",
        "device-split-count",
        "DEVICESPLITCOUNT",
        "split_count",
        "splitCount",
    ],
)
def test_key_spellings(key: str) -> None:
    assert parse_node_config(f"defaults: {{{key}: 7}}", "n").split_count == 7
    assert parse_node_config(f"nodeconfig: [{{name: n, {key}: 8}}]", "n").split_count == 8


def test_every_field_by_hami_and_by_field_name() -> None:
    hami = """
defaults:
  devicememoryscaling: 2
  devicecorescaling: 3
  libcudaloglevel: 0
  gpucorepolicy: disable
  contextoverhead: 0
  operatingmode: hami-core
  filterdevices: {UUID: [GPU-x], Index: [1]}
  simulate: {Count: 1, memory_mib: 100, numa_nodes: 1, MODEL: X}
"""
    ours = """
defaults:
  memory_scaling: 2
  core_scaling: 3
  log_level: 0
  core_policy: disable
  context_overhead_mib: 0
  operating_mode: hami-core
  filter_devices: {uuids: [GPU-x], indices: [1]}
  simulate: {count: 1, memoryMiB: 100, numaNodes: 1, model: X}
"""
    a, b = parse_node_config(hami, "n"), parse_node_config(ours, "n")
    assert a == b
    assert (a.memory_scaling, a.core_scaling, a.log_level, a.core_policy) == (2, 3, 0, "disable")
    assert a.context_overhead_mib == 0
    assert a.simulate == SimulatedGpus(count=1, memory_mib=100, model="X")


def test_json_and_yaml_files_read_the_same(tmp_path: Path) -> None:
    hami_json = {
        "nodeconfig": [
            {
                "name": "gpu-node-1",
                "devicememoryscaling": 1.8,
                "devicesplitcount": 10,
                "filterdevices": {"uuid": [], "index": [1]},
            }
        ]
    }
    as_json = tmp_path / "config.json"
    as_json.write_text(json.dumps(hami_json))
    as_yaml = tmp_path / "config.yaml"
    as_yaml.write_text(
        "nodeconfig:\n"
        "  - name: gpu-node-1\n"
        "    devicememoryscaling: 1.8\n"
        "    devicesplitcount: 10\n"
        "    filterdevices:\n"
        "      uuid: []\n"
        "      index: [1]\n"
    )
    config = load_node_config(as_json, "gpu-node-1")
    assert config == load_node_config(str(as_yaml), "gpu-node-1")
    assert config.memory_scaling == 1.8
    assert config.filter_devices == FilterDevices(indices=(1,))


def test_inventory_carries_the_sharing_settings() -> None:
    config = parse_node_config(FULL, "gpu-node-1")
    devices = [gpu(0), gpu(1)]
    inventory = config.inventory("gpu-node-1", devices)
    assert inventory.node == "gpu-node-1"
    assert inventory.devices == tuple(devices)
    assert (inventory.split_count, inventory.memory_scaling, inventory.core_scaling) == (
        6,
        1.5,
        2.0,
    )
    assert inventory.capacity(devices[0]).memory_mib == 1536


def test_filter_devices_excludes_by_uuid_in_any_case_and_by_index() -> None:
    filt = FilterDevices(uuids=("gpu-ABC",), indices=(2,))
    assert filt.excludes(gpu(0, "GPU-abc"))
    assert filt.excludes(gpu(2))
    assert not filt.excludes(gpu(1))
    assert not FilterDevices().excludes(gpu(0))


def test_simulated_gpus_spread_over_numa_nodes_in_contiguous_runs() -> None:
    four = SimulatedGpus(count=4, numa_nodes=2)
    assert [four.numa_of(i) for i in range(4)] == [0, 0, 1, 1]
    three = SimulatedGpus(count=3, numa_nodes=3)
    assert [three.numa_of(i) for i in range(3)] == [0, 1, 2]
    assert [SimulatedGpus(count=2).numa_of(i) for i in range(2)] == [0, 0]


# ------------------------------------------------------------------------ errors


def test_unknown_keys_are_named_with_their_place() -> None:
    text = """
defaults:
  deviceSplitCount: 4
  filterDevices: {uuid: [], serial: [1]}
nodeconfig:
  - name: gpu-node-0
  - name: gpu-node-1
    devicesplitcnt: 3
unexpected: 1
"""
    assert problems(text) == [
        "unknown top-level key 'unexpected' (expected defaults, nodeconfig)",
        "defaults: unknown key 'filterDevices.serial'",
        "nodeconfig[1] (gpu-node-1): unknown key 'devicesplitcnt'",
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "defaults: {deviceSplitCount: 0}",
            "defaults: deviceSplitCount: Input should be greater than or equal to 1",
        ),
        (
            "nodeconfig: [{name: n, devicememoryscaling: -1}]",
            "nodeconfig[0] (n): devicememoryscaling: Input should be greater than 0",
        ),
        (
            "defaults: {device_core_scaling: 101}",
            "defaults: device_core_scaling: Input should be less than or equal to 100",
        ),
        (
            "defaults: {operatingMode: timeslicing}",
            "defaults: operatingMode: only 'hami-core', 'mig' and 'mps' are supported, "
            "not 'timeslicing'",
        ),
        (
            "defaults: {mps: {pipeDirectory: run/mps}}",
            "defaults: mps.pipeDirectory: String should match pattern '^/[!-~]*$'",
        ),
        (
            "defaults: {mps: {shmDirectory: /run/mps/../../etc}}",
            "defaults: mps.shmDirectory: '/run/mps/../../etc' has '.' or '..' in it; "
            "give the directory itself",
        ),
        (  # "//" is the host's root: mounted writable at every container's /dev/shm
            "defaults: {mps: {shmDirectory: //}}",
            "defaults: mps.shmDirectory: '//' has an empty part ('//' or a trailing '/'); "
            "give the directory itself",
        ),
        (
            "defaults: {mps: {shmDirectory: /run//mps/}}",
            "defaults: mps.shmDirectory: '/run//mps/' has an empty part ('//' or a trailing '/'); "
            "give the directory itself",
        ),
        (  # a directory just below the root is the host's own (/etc, /var, /dev, /root)
            "defaults: {mps: {shmDirectory: /etc}}",
            "defaults: mps.shmDirectory: '/etc' is a directory of the host itself; "
            "give the MPS daemon's own directory below it",
        ),
        (
            "defaults: {mps: {pipeDirectory: /dev}}",
            "defaults: mps.pipeDirectory: '/dev' is a directory of the host itself; "
            "give the MPS daemon's own directory below it",
        ),
        (  # the writable shm mount would hold the pipe: a tenant could replace the socket
            "defaults: {mps: {shmDirectory: /run/nvidia/mps}}",
            "defaults: mps: shmDirectory '/run/nvidia/mps' holds pipeDirectory "
            "'/run/nvidia/mps/nvidia.com/gpu/pipe': mounted writable, it would let containers "
            "replace the daemon's socket; give them apart, or set writablePipe",
        ),
        (
            "defaults: {mps: {shmDirectory: /run/mps/a, pipeDirectory: /run/mps/a}}",
            "defaults: mps: shmDirectory '/run/mps/a' holds pipeDirectory '/run/mps/a': "
            "mounted writable, it would let containers replace the daemon's socket; "
            "give them apart, or set writablePipe",
        ),
        (
            "defaults: {mps: {pipe_directory: '/run/with space'}}",
            "defaults: mps.pipe_directory: String should match pattern '^/[!-~]*$'",
        ),
        (
            "defaults: {mps: {writablePipe: sometimes}}",
            "defaults: mps.writablePipe: Input should be a valid boolean, "
            "unable to interpret input",
        ),
        (
            "defaults: {migStrategy: single}",
            "defaults: migStrategy: 'single' is not supported: it advertises MIG instances as "
            "nvidia.com/gpu, which here counts shared whole cards; use 'mixed' "
            "(nvidia.com/mig-<profile>)",
        ),
        (
            "defaults: {migStrategy: all}",
            "defaults: migStrategy: only 'none' and 'mixed' are supported, not 'all'",
        ),
        (
            "defaults: {migProfileAllowlist: [{models: [A100], profiles: [3g]}]}",
            "defaults: migProfileAllowlist[0].profiles[0]: String should match pattern "
            "'^([1-9][0-9]?c\\.)?[1-9][0-9]?g\\.[1-9][0-9]{0,4}gb(\\+[a-z]{1,8})?$'",
        ),
        (
            "defaults: {migProfileAllowlist: [{models: [], profiles: [3g.20gb]}]}",
            "defaults: migProfileAllowlist[0]: an allowlist entry needs models and profiles",
        ),
        (
            "defaults: {simulate: {mig: true}}",
            "defaults: simulate.mig needs operatingMode: mig,"
            " or simulate.instances with migStrategy: mixed",
        ),
        (
            "defaults: {simulate: {mig: true, instances: [3g.20gb]}}",
            "defaults: simulate.mig needs operatingMode: mig,"
            " or simulate.instances with migStrategy: mixed",
        ),
        (
            "defaults: {simulate: {instances: [3g.20gb]}, migStrategy: mixed}",
            "defaults: simulate: simulate.instances needs simulate.mig: true",
        ),
        (
            "defaults: {simulate: {mig: true, instances: [4g.20gb, 4g.20gb]}, migStrategy: mixed}",
            "defaults: simulate: simulate.instances: MIG profile 4g.20gb does not fit"
            " beside 4g.20gb",
        ),
        (
            "defaults: {simulate: {mig: true, instances: [9g.80gb]}, migStrategy: mixed}",
            "defaults: simulate: simulate.instances: no MIG profile 9g.80gb (the card offers"
            " 1g.5gb, 1g.10gb, 2g.10gb, 3g.20gb, 4g.20gb, 7g.40gb)",
        ),
        (
            "defaults: {libCudaLogLevel: 5}",
            "defaults: libCudaLogLevel: Input should be less than or equal to 4",
        ),
        (
            "defaults: {gpuCorePolicy: sometimes}",
            "defaults: gpuCorePolicy: Input should be 'default', 'force' or 'disable'",
        ),
        (
            "defaults: {contextOverhead: -5}",
            "defaults: contextOverhead: Input should be greater than or equal to 0",
        ),
        (
            "defaults: {filterDevices: {index: [0, x]}}",
            "defaults: filterDevices.index[1]: Input should be a valid integer, "
            "unable to parse string as an integer",
        ),
        (
            "defaults: {simulate: {count: 2, unhealthy: [2]}}",
            "defaults: simulate: unhealthy indices [2] are not among the 2 GPUs",
        ),
        (
            "defaults: {simulate: {count: 17}}",
            "defaults: simulate.count: Input should be less than or equal to 16",
        ),
        (
            "defaults: {simulate: {memoryMiB: 0}}",
            "defaults: simulate.memoryMiB: Input should be greater than 0",
        ),
        (
            "defaults: {filterDevices: [1]}",
            "defaults: filterDevices: Input should be a valid dictionary or instance of "
            "FilterDevices",
        ),
    ],
)
def test_bad_values_name_the_key_and_the_problem(text: str, expected: str) -> None:
    assert problems(text) == [expected]


def test_every_node_entry_is_checked_not_only_this_nodes() -> None:
    text = "nodeconfig: [{name: a, deviceSplitCount: 2}, {name: b, deviceSplitCount: 0}]"
    assert problems(text, node="a") == [
        "nodeconfig[1] (b): deviceSplitCount: Input should be greater than or equal to 1"
    ]


def test_several_problems_come_one_per_line() -> None:
    text = "defaults: {deviceSplitCount: 0, deviceMemoryScaling: 0, bogus: 1}"
    assert problems(text) == [
        "defaults: unknown key 'bogus'",
        "defaults: deviceSplitCount: Input should be greater than or equal to 1",
        "defaults: deviceMemoryScaling: Input should be greater than 0",
    ]


def test_a_key_given_twice_in_two_spellings() -> None:
    assert problems("defaults: {deviceSplitCount: 3, device_split_count: 4}") == [
        "defaults: key 'device_split_count' repeats 'deviceSplitCount'"
    ]


def test_duplicate_node_entries() -> None:
    text = "nodeconfig: [{name: a}, {name: b}, {name: a, devicesplitcount: 3}]"
    assert problems(text, node="b") == [
        "nodeconfig[2] (a): node 'a' is already configured by nodeconfig[0] (a)"
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[1, 2]", "the top level must be a mapping (defaults, nodeconfig), not list"),
        ("just words", "the top level must be a mapping (defaults, nodeconfig), not str"),
        ("nodeconfig: {name: a}", "nodeconfig: must be a list of node entries, not dict"),
        ("defaults: [1]", "defaults: must be a mapping, not list"),
        ("nodeconfig: [{devicesplitcount: 2}]", "nodeconfig[0]: needs a 'name': the node's name"),
        ("nodeconfig: [{name: 7}]", "nodeconfig[0]: needs a 'name': the node's name"),
        ("nodeconfig: [gpu-node-1]", "nodeconfig[0]: must be a mapping, not str"),
        ("defaults: {a: [", "not YAML or JSON: line 1, column 16: expected the node content"),
    ],
)
def test_malformed_structure(text: str, expected: str) -> None:
    (problem,) = problems(text)
    assert problem.startswith(expected), problem


def test_unreadable_files_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "absent.yaml"
    with pytest.raises(NodeConfigError) as info:
        load_node_config(missing, "n")
    assert str(info.value) == f"{missing}: cannot read: No such file or directory"
    with pytest.raises(NodeConfigError) as info:
        load_node_config(tmp_path, "n")
    assert str(info.value) == f"{tmp_path}: cannot read: Is a directory"
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(NodeConfigError, match=rf"^{binary}: not UTF-8 text"):
        load_node_config(binary, "n")


def test_errors_in_a_file_start_with_its_path(tmp_path: Path) -> None:
    path = tmp_path / "nodes.yaml"
    path.write_text("defaults:\n  deviceSplitCount: 0\n")
    with pytest.raises(NodeConfigError) as info:
        load_node_config(path, "n")
    assert str(info.value) == (
        f"{path}: defaults: deviceSplitCount: Input should be greater than or equal to 1"
    )


def test_hami_keys_without_meaning_here_are_ignored_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hami = json.dumps(
        {
            "nodeconfig": [
                {
                    "name": "n1",
                    "operatingmode": "hami-core",
                    "devicememoryscaling": 1.8,
                    "devicesplitcount": 10,
                    "migstrategy": "mixed",
                    "enablegetpreferredallocation": True,
                    "filterdevices": {"uuid": [], "index": []},
                }
            ]
        }
    )
    config = parse_node_config(hami, "n1")
    assert (config.memory_scaling, config.split_count, config.mig_strategy) == (1.8, 10, "mixed")
    assert "'enablegetpreferredallocation' ignored" in caplog.text


def test_mig_keys_in_hamis_spelling() -> None:
    text = """
defaults:
  operatingMode: mig
  migProfileAllowlist:
    - models: [A30]
      profiles: [1g.6gb]
    - models: [A100-SXM4-40GB, A100-PCIE-40GB]
      profiles: [1g.5gb, 3g.20gb, 7g.40gb]
nodeconfig:
  - {name: plain, operatingmode: hami-core, migstrategy: mixed}
"""
    config = parse_node_config(text, "n1")
    assert (config.operating_mode, config.mig_strategy) == ("mig", "none")
    assert config.mig_allowed("NVIDIA A100-SXM4-40GB") == {"1g.5gb", "3g.20gb", "7g.40gb"}
    assert config.mig_allowed("NVIDIA H100 80GB HBM3") == frozenset()
    plain = parse_node_config(text, "plain")
    assert (plain.operating_mode, plain.mig_strategy) == ("hami-core", "mixed")
    assert NodeConfig().mig_allowed("anything") is None  # no allowlist: every profile


def test_simulated_mig_cards_on_a_mig_node() -> None:
    config = parse_node_config("defaults: {operatingMode: mig, simulate: {mig: true}}", "n")
    assert config.simulate.mig
