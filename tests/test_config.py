"""Settings read from GPUSLICE_* environment variables, and the errors naming them."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError
from pydantic_settings import BaseSettings

from gpuslice_common.config import (
    CommonSettings,
    ConfigError,
    DevicePluginSettings,
    InventorySettings,
    RequestDefaults,
    ResourceNames,
    SchedulerSettings,
    WebhookSettings,
    env_name,
    load,
    parse_duration,
    sentinel_addresses,
    without_password,
)
from gpuslice_common.models import GpuPolicy


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPUSLICE_* variable from the outer environment leaks into a test."""
    for name in list(os.environ):
        if name.upper().startswith("GPUSLICE_"):
            monkeypatch.delenv(name)


def set_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def config_error(cls: type[BaseSettings] = CommonSettings) -> str:
    with pytest.raises(ConfigError) as info:
        load(cls)
    return str(info.value)


# ---------------------------------------------------------------- loading


def test_defaults_load_with_no_environment() -> None:
    s = load(CommonSettings)
    assert s.nats_url == "nats://127.0.0.1:4222"
    assert s.nats_user is None
    assert s.nats_password is None
    assert s.nats_creds_file is None
    assert s.redis_url == "redis://127.0.0.1:6379/0"
    assert s.subject_prefix == "gpuslice"
    assert s.ledger_prefix == "gpuslice"
    assert s.audit_max_age == timedelta(days=90)
    assert s.connect_wait == timedelta(seconds=10)
    assert s.log_level == "INFO"
    assert s.requests.resources == ResourceNames()
    assert s.requests.resources.gpu == "nvidia.com/gpu"
    assert s.requests.defaults == RequestDefaults()
    assert s.requests.default_gpu_policy is GpuPolicy.FRAGMENTATION


# Every scalar CommonSettings field: (environment value, value it loads as).
COMMON_FIELDS: dict[str, tuple[str, Any]] = {
    "nats_url": ("nats://bus-1:4222,tls://bus-2:4443", "nats://bus-1:4222,tls://bus-2:4443"),
    "nats_user": ("scheduler", "scheduler"),
    "nats_password": ("s3cret", "s3cret"),
    "nats_creds_file": ("/etc/gpuslice/nats.creds", "/etc/gpuslice/nats.creds"),
    "nats_token_file": ("/var/run/secrets/nats/token", "/var/run/secrets/nats/token"),
    "redis_url": ("rediss://ledger:6380/2", "rediss://ledger:6380/2"),
    "subject_prefix": ("my-co", "my-co"),
    "ledger_prefix": ("ledger_1", "ledger_1"),
    "audit_max_age": ("7d", timedelta(days=7)),
    "connect_wait": ("750ms", timedelta(milliseconds=750)),
    "redis_cluster": ("true", True),
    "log_level": ("debug", "DEBUG"),
    "audit_replicas": ("3", 3),
    "hami_metrics": ("false", False),
    "device_config": ("/etc/gpuslice/device-config.yaml", "/etc/gpuslice/device-config.yaml"),
}
# The Redis Sentinel fields (they exclude redis_cluster, so they load apart).
SENTINEL_FIELDS: dict[str, tuple[str, Any]] = {
    "redis_sentinels": ("redis-0.r:26379,[::1]:26380", "redis-0.r:26379,[::1]:26380"),
    "redis_sentinel_service": ("ledger.main", "ledger.main"),
    "redis_sentinel_user": ("clients", "clients"),
    "redis_sentinel_password": ("s3cret", "s3cret"),
}


def test_the_field_table_covers_every_common_field() -> None:
    fields = set(COMMON_FIELDS) | set(SENTINEL_FIELDS) | {"requests"}
    assert fields == set(CommonSettings.model_fields)


def test_the_sentinel_fields_are_read_from_their_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    set_env(monkeypatch, {env_name((f,)): raw for f, (raw, _) in SENTINEL_FIELDS.items()})
    s = load(CommonSettings)
    for field, (_, expected) in SENTINEL_FIELDS.items():
        assert getattr(s, field) == expected, field
    assert sentinel_addresses(s.redis_sentinels or "") == [("redis-0.r", 26379), ("::1", 26380)]


@pytest.mark.parametrize(
    "bad",
    [
        "redis-0",
        "redis-0:",
        ":26379",
        "r:0",
        "r:65536",
        "r:26379,,",
        "redis://r:26379",
        "http://x:26379",
        "a:1:2",
        "sentinel-0 :26379",
        "::1:26379",
    ],
)
def test_a_bad_sentinel_address_is_named(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    set_env(monkeypatch, {"GPUSLICE_REDIS_SENTINELS": bad})
    assert "GPUSLICE_REDIS_SENTINELS: not a sentinel address" in config_error()


def test_sentinels_take_a_plain_redis_url_only(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(
        monkeypatch,
        {"GPUSLICE_REDIS_SENTINELS": "r:26379", "GPUSLICE_REDIS_URL": "rediss://u:p@r:6380/0"},
    )
    assert "must be redis://" in config_error()


def test_sentinels_and_a_redis_cluster_exclude_each_other(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, {"GPUSLICE_REDIS_SENTINELS": "r:26379", "GPUSLICE_REDIS_CLUSTER": "1"})
    assert "exclude each other" in config_error()


@pytest.mark.parametrize("bad", ["0", "6", "three"])
def test_audit_replicas_are_one_to_five(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    set_env(monkeypatch, {"GPUSLICE_AUDIT_REPLICAS": bad})
    assert "GPUSLICE_AUDIT_REPLICAS" in config_error()


def test_every_common_field_is_read_from_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, {env_name((f,)): raw for f, (raw, _) in COMMON_FIELDS.items()})
    s = load(CommonSettings)
    for field, (_, expected) in COMMON_FIELDS.items():
        assert getattr(s, field) == expected, field


@pytest.mark.parametrize("field", sorted(COMMON_FIELDS))
def test_each_variable_alone_changes_only_its_field(
    monkeypatch: pytest.MonkeyPatch, field: str
) -> None:
    raw, expected = COMMON_FIELDS[field]
    monkeypatch.setenv(f"GPUSLICE_{field.upper()}", raw)
    s = load(CommonSettings)
    defaults = CommonSettings()
    assert getattr(s, field) == expected
    assert s.model_dump(exclude={field}) == defaults.model_dump(exclude={field})


def test_nested_request_settings_use_a_double_underscore(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    set_env(
        monkeypatch,
        {
            "GPUSLICE_REQUESTS__RESOURCES__GPU": "example.com/vgpu",
            "GPUSLICE_REQUESTS__DEFAULTS__MEMORY_MIB": "2048",
            "GPUSLICE_REQUESTS__DEFAULT_GPU_POLICY": "binpack",
        },
    )
    s = load(CommonSettings)
    assert s.requests.resources.gpu == "example.com/vgpu"
    assert s.requests.defaults.memory_mib == 2048
    assert s.requests.default_gpu_policy is GpuPolicy.BINPACK
    # siblings keep their defaults
    assert s.requests.resources.memory == "nvidia.com/gpumem"
    assert s.requests.defaults.gpu_count == 1
    assert s.requests.defaults.cores == 0


def test_a_nested_group_may_also_be_given_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSLICE_REQUESTS", '{"defaults": {"cores": 50}}')
    s = load(CommonSettings)
    assert s.requests.defaults.cores == 50
    assert s.requests.defaults.gpu_count == 1


def test_overrides_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSLICE_LOG_LEVEL", "error")
    assert load(CommonSettings).log_level == "ERROR"
    assert load(CommonSettings, log_level="warning").log_level == "WARNING"


def test_settings_are_frozen() -> None:
    s = load(CommonSettings)
    with pytest.raises(ValidationError):
        s.log_level = "DEBUG"
    assert s.log_level == "INFO"


# ---------------------------------------------------------------- errors name the variable


@pytest.mark.parametrize(
    ("env", "variable", "complaint"),
    [
        ({"GPUSLICE_NATS_URL": "http://x"}, "GPUSLICE_NATS_URL", "not a NATS URL"),
        ({"GPUSLICE_NATS_URL": "nats://a:1,http://b"}, "GPUSLICE_NATS_URL", "'http://b'"),
        ({"GPUSLICE_REDIS_URL": "http://x"}, "GPUSLICE_REDIS_URL", "not a Redis URL"),
        ({"GPUSLICE_SUBJECT_PREFIX": "gpu.slice"}, "GPUSLICE_SUBJECT_PREFIX", "one token"),
        ({"GPUSLICE_LEDGER_PREFIX": "a b"}, "GPUSLICE_LEDGER_PREFIX", "one token"),
        # a trailing newline (a value read from a file) must not pass a '$'-anchored check
        ({"GPUSLICE_SUBJECT_PREFIX": "gpuslice\n"}, "GPUSLICE_SUBJECT_PREFIX", "one token"),
        (
            {"GPUSLICE_REQUESTS__RESOURCES__CORES": "nvidia.com/gpucores\n"},
            "GPUSLICE_REQUESTS__RESOURCES__CORES",
            "not a Kubernetes resource name",
        ),
        ({"GPUSLICE_LOG_LEVEL": "loud"}, "GPUSLICE_LOG_LEVEL", "unknown log level"),
        ({"GPUSLICE_AUDIT_MAX_AGE": "forever"}, "GPUSLICE_AUDIT_MAX_AGE", "not a duration"),
        ({"GPUSLICE_AUDIT_MAX_AGE": "0s"}, "GPUSLICE_AUDIT_MAX_AGE", "positive"),
        (
            {"GPUSLICE_REQUESTS__RESOURCES__GPU": "Not A Name!"},
            "GPUSLICE_REQUESTS__RESOURCES__GPU",
            "not a Kubernetes resource name",
        ),
        (
            {"GPUSLICE_REQUESTS__DEFAULTS__CORES": "101"},
            "GPUSLICE_REQUESTS__DEFAULTS__CORES",
            "less than or equal to 100",
        ),
        (
            {"GPUSLICE_REQUESTS__DEFAULTS__GPU_COUNT": "0"},
            "GPUSLICE_REQUESTS__DEFAULTS__GPU_COUNT",
            "greater than or equal to 1",
        ),
        (
            {"GPUSLICE_REQUESTS__DEFAULT_GPU_POLICY": "random"},
            "GPUSLICE_REQUESTS__DEFAULT_GPU_POLICY",
            "'binpack'",
        ),
    ],
)
def test_a_bad_value_names_its_variable(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], variable: str, complaint: str
) -> None:
    set_env(monkeypatch, env)
    message = config_error()
    assert message.startswith("invalid configuration: ")
    assert f"{variable}: " in message
    assert complaint in message


def test_a_missing_required_variable_is_named() -> None:
    message = config_error(DevicePluginSettings)
    assert message == "invalid configuration: GPUSLICE_NODE_NAME: is required but not set"


def test_an_empty_required_variable_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSLICE_NODE_NAME", "")
    message = config_error(DevicePluginSettings)
    assert "GPUSLICE_NODE_NAME: " in message
    assert "at least 1 character" in message


def test_every_bad_variable_is_named_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(
        monkeypatch,
        {
            "GPUSLICE_NATS_URL": "http://x",
            "GPUSLICE_LOG_LEVEL": "loud",
            "GPUSLICE_AUDIT_MAX_AGE": "forever",
            "GPUSLICE_REQUESTS__DEFAULTS__CORES": "101",
        },
    )
    message = config_error(DevicePluginSettings)
    for variable in (
        "GPUSLICE_NATS_URL",
        "GPUSLICE_LOG_LEVEL",
        "GPUSLICE_AUDIT_MAX_AGE",
        "GPUSLICE_REQUESTS__DEFAULTS__CORES",
        "GPUSLICE_NODE_NAME",
    ):
        assert f"{variable}: " in message, variable
    assert message.count("; ") == 4


def test_the_error_carries_no_traceback_or_pydantic_noise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    set_env(monkeypatch, {"GPUSLICE_NATS_URL": "http://x", "GPUSLICE_LISTEN_PORT": "many"})
    with pytest.raises(ConfigError) as info:
        load(WebhookSettings)
    message = str(info.value)
    assert "GPUSLICE_NATS_URL: " in message
    assert "GPUSLICE_LISTEN_PORT: " in message
    assert "Traceback" not in message
    assert "pydantic" not in message.lower()
    assert "http" not in message.replace("'http://x'", "")
    assert "Value error," not in message
    assert "\n" not in message
    # raised "from None": no chained ValidationError is printed under it
    assert info.value.__cause__ is None
    assert info.value.__suppress_context__


def test_a_group_variable_that_is_not_json_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GPUSLICE_REQUESTS", "not json")
    message = config_error()
    assert "GPUSLICE_REQUESTS: " in message
    assert "Traceback" not in message


def test_a_duration_too_long_for_timedelta_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GPUSLICE_AUDIT_MAX_AGE", "99999999999d")
    message = config_error()
    assert "GPUSLICE_AUDIT_MAX_AGE: " in message


def test_env_name_joins_nested_locations() -> None:
    assert env_name(("nats_url",)) == "GPUSLICE_NATS_URL"
    assert env_name(("requests", "defaults", "memory_mib")) == (
        "GPUSLICE_REQUESTS__DEFAULTS__MEMORY_MIB"
    )


# ---------------------------------------------------------------- durations


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("30s", timedelta(seconds=30)),
        ("5m", timedelta(minutes=5)),
        ("2h", timedelta(hours=2)),
        ("30d", timedelta(days=30)),
        ("250ms", timedelta(milliseconds=250)),
        ("1.5h", timedelta(minutes=90)),
        (" 5 m ", timedelta(minutes=5)),
        ("12", timedelta(seconds=12)),
        ("0.5", timedelta(milliseconds=500)),
        (12, timedelta(seconds=12)),
        (3.5, timedelta(seconds=3.5)),
        (timedelta(minutes=3), timedelta(minutes=3)),
    ],
)
def test_parse_duration_accepts(value: Any, expected: timedelta) -> None:
    assert parse_duration(value) == expected


@pytest.mark.parametrize(
    "value",
    [
        "",
        "   ",
        "5 parsecs",
        "5min",
        "1e3",
        "-1s",
        "0s",
        "0",
        "0ms",
        -1,
        0,
        0.0,
        True,
        False,
        None,
        "nan",
        float("nan"),
        float("inf"),
        "1" + "0" * 400 + "s",
        "99999999999d",
        [30],
    ],
)
def test_parse_duration_rejects(value: Any) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - the ValueError is the contract
        parse_duration(value)


def test_parse_duration_messages_explain() -> None:
    with pytest.raises(ValueError, match=r"not a duration: '5 parsecs' \(use e\.g\. 30s"):
        parse_duration("5 parsecs")
    with pytest.raises(ValueError, match="must be positive"):
        parse_duration("0s")


# ---------------------------------------------------------------- per-service settings


def test_webhook_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load(WebhookSettings).listen_port == 8443
    set_env(
        monkeypatch,
        {
            "GPUSLICE_LISTEN_HOST": "127.0.0.1",
            "GPUSLICE_LISTEN_PORT": "9443",
            "GPUSLICE_TLS_CERT_FILE": "/tls/tls.crt",
            "GPUSLICE_TLS_KEY_FILE": "/tls/tls.key",
            "GPUSLICE_SCHEDULER_NAME": "my-scheduler",
            "GPUSLICE_SUBJECT_PREFIX": "hooks",
        },
    )
    s = load(WebhookSettings)
    assert (s.listen_host, s.listen_port) == ("127.0.0.1", 9443)
    assert (s.tls_cert_file, s.tls_key_file) == ("/tls/tls.crt", "/tls/tls.key")
    assert s.scheduler_name == "my-scheduler"
    assert s.subject_prefix == "hooks"  # the common fields come along


def test_webhook_policy_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = load(WebhookSettings)
    assert defaults.keep_other_schedulers
    assert defaults.hide_gpus_from_other_containers
    assert defaults.core_policy is None
    assert not defaults.allow_limit_opt_out
    set_env(
        monkeypatch,
        {
            "GPUSLICE_KEEP_OTHER_SCHEDULERS": "false",
            "GPUSLICE_CORE_POLICY": "force",
            "GPUSLICE_KUBE_CACHE_TTL": "30s",
            "GPUSLICE_KUBE_API": "none",
        },
    )
    s = load(WebhookSettings)
    assert not s.keep_other_schedulers
    assert s.core_policy == "force"
    assert s.kube_cache_ttl.total_seconds() == 30
    assert s.kube_api == "none"


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"GPUSLICE_TLS_CERT_FILE": "/tls/tls.crt"}, "GPUSLICE_TLS_KEY_FILE"),
        ({"GPUSLICE_SCHEDULER_NAME": "Not A Name"}, "GPUSLICE_SCHEDULER_NAME"),
        ({"GPUSLICE_CORE_POLICY": "sometimes"}, "GPUSLICE_CORE_POLICY"),
        ({"GPUSLICE_EVENT_QUEUE_SIZE": "0"}, "GPUSLICE_EVENT_QUEUE_SIZE"),
    ],
)
def test_webhook_settings_errors_name_the_variable(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], named: str
) -> None:
    set_env(monkeypatch, env)
    with pytest.raises(ConfigError, match=named) as caught:
        load(WebhookSettings)
    assert "GPUSLICE_:" not in str(caught.value)


def test_scheduler_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load(SchedulerSettings).listen_port == 8888
    monkeypatch.setenv("GPUSLICE_LISTEN_PORT", "18888")
    monkeypatch.setenv("GPUSLICE_REQUESTS__DEFAULTS__CORES", "25")
    s = load(SchedulerSettings)
    assert s.listen_port == 18888
    assert s.requests.defaults.cores == 25


def test_inventory_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = load(InventorySettings)
    assert defaults.heartbeat_interval == timedelta(seconds=10)
    assert defaults.reservation_ttl == timedelta(minutes=5)
    assert defaults.listen_port == 9090
    monkeypatch.setenv("GPUSLICE_HEARTBEAT_INTERVAL", "3s")
    monkeypatch.setenv("GPUSLICE_RESERVATION_TTL", "2m")
    s = load(InventorySettings)
    assert s.heartbeat_interval == timedelta(seconds=3)
    assert s.reservation_ttl == timedelta(minutes=2)


def test_device_plugin_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(
        monkeypatch,
        {
            "GPUSLICE_NODE_NAME": "gpu-1.example.com",
            "GPUSLICE_KUBELET_DIR": "/tmp/plugins",
            "GPUSLICE_METRICS_PORT": "19400",
        },
    )
    s = load(DevicePluginSettings)
    assert s.node_name == "gpu-1.example.com"
    assert s.kubelet_dir == "/tmp/plugins"
    assert s.metrics_port == 19400


def test_the_node_agent_has_no_ledger_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The node agent asks the inventory; a Redis URL in its environment is not read."""
    set_env(
        monkeypatch,
        {"GPUSLICE_NODE_NAME": "n1", "GPUSLICE_REDIS_URL": "redis://agent:pw@redis:6379/0"},
    )
    s = load(DevicePluginSettings)
    fields = set(DevicePluginSettings.model_fields)
    assert not fields & {"redis_url", "redis_cluster", "ledger_prefix"}
    assert "pw" not in s.model_dump_json()
    assert (s.inventory_timeout.total_seconds(), s.allocate_timeout.total_seconds()) == (2, 30)


def test_the_grant_directory_is_not_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interposer reads /run/gpuslice whatever the agent is told: a setting that
    moved the mount elsewhere would leave containers without their grant."""
    set_env(
        monkeypatch,
        {"GPUSLICE_NODE_NAME": "n1", "GPUSLICE_CONTAINER_REGION_DIR": "/somewhere/else"},
    )
    s = load(DevicePluginSettings)
    assert "container_region_dir" not in DevicePluginSettings.model_fields
    assert "/somewhere/else" not in s.model_dump_json()
    assert s.container_lib_dir == "/usr/local/gpuslice"


@pytest.mark.parametrize(
    ("cls", "env", "variable"),
    [
        (WebhookSettings, {"GPUSLICE_LISTEN_PORT": "70000"}, "GPUSLICE_LISTEN_PORT"),
        (SchedulerSettings, {"GPUSLICE_LISTEN_PORT": "0"}, "GPUSLICE_LISTEN_PORT"),
        (InventorySettings, {"GPUSLICE_HEARTBEAT_INTERVAL": "soon"}, "GPUSLICE_HEARTBEAT_INTERVAL"),
        (InventorySettings, {"GPUSLICE_RESERVATION_TTL": "-5m"}, "GPUSLICE_RESERVATION_TTL"),
        (
            DevicePluginSettings,
            {"GPUSLICE_NODE_NAME": "n1", "GPUSLICE_METRICS_PORT": "x"},
            "GPUSLICE_METRICS_PORT",
        ),
    ],
)
def test_service_fields_name_their_variable(
    monkeypatch: pytest.MonkeyPatch,
    cls: type[BaseSettings],
    env: dict[str, str],
    variable: str,
) -> None:
    set_env(monkeypatch, env)
    message = config_error(cls)
    assert message.startswith(f"invalid configuration: {variable}: ")
    assert message.count("GPUSLICE_") == 1


def test_service_fields_are_ignored_by_other_services(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSLICE_HEARTBEAT_INTERVAL", "not-a-duration")
    monkeypatch.setenv("GPUSLICE_SOMETHING_ELSE", "x")
    s: BaseModel = load(WebhookSettings)
    assert "heartbeat_interval" not in s.model_dump()
    with pytest.raises(ConfigError, match="GPUSLICE_HEARTBEAT_INTERVAL"):
        load(InventorySettings)


def test_each_http_service_caps_request_bodies_and_the_cap_is_a_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mib = 1024 * 1024
    assert SchedulerSettings().max_request_body == 64 * mib  # full Node objects
    assert WebhookSettings().max_request_body == 8 * mib  # AdmissionReview
    assert InventorySettings().max_request_body == 64 * 1024  # probes and metrics
    assert DevicePluginSettings(node_name="n").max_request_body == 64 * 1024
    monkeypatch.setenv("GPUSLICE_MAX_REQUEST_BODY", "128MiB")
    assert SchedulerSettings().max_request_body == 128 * mib
    for bad in ("lots", "10", "2GiB"):  # not a size, below 1 KiB, above 1 GiB
        monkeypatch.setenv("GPUSLICE_MAX_REQUEST_BODY", bad)
        with pytest.raises(ConfigError, match="GPUSLICE_MAX_REQUEST_BODY"):
            load(SchedulerSettings)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("GPUSLICE_REDIS_URL", "http://scheduler:hunter2secret@redis:6379/0"),
        ("GPUSLICE_REDIS_URL", "redis//:hunter2secret@redis:6379/0"),
        ("GPUSLICE_NATS_URL", "nats://h:4222,nats//auditor:hunter2secret@h:4222"),
        ("GPUSLICE_NATS_URL", "http://auditor:hunter2secret@h:4222"),
    ],
)
def test_a_bad_url_is_named_without_its_password(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    """The message goes to a pod's log or a terminal: the URL's password stays out."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as raised:
        load(CommonSettings)
    assert variable in str(raised.value)
    assert "hunter2secret" not in str(raised.value)


def test_without_password_keeps_the_user_and_every_server() -> None:
    assert without_password("redis://u:pw@h:1/0") == "redis://u@h:1/0"
    assert without_password("redis://:pw@h:1/0") == "redis://h:1/0"
    assert without_password("redis://h:1/0") == "redis://h:1/0"
    assert without_password("nats://a:p@h:1,nats://b:q@g:2") == "nats://a@h:1,nats://b@g:2"
    assert without_password("redis//:pw@h") == "(a URL, not shown: it may hold a password)"
