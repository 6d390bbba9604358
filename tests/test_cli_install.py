"""``gpuslice install``: the credentials Secret and the webhook's certificate,
made and kept by the real ``kubernetes`` client against the local API server
(tests/kubeapi.py), which keeps the objects it is sent."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from kubernetes import client as k8s
from typer.testing import CliRunner

from gpuslice_cli.install import (
    CREDENTIALS,
    KEYS,
    MANAGED_BY,
    MANAGER,
    CertPolicy,
    InstallError,
    WebhookTarget,
    ensure_credentials,
    ensure_webhook_cert,
    install,
)
from gpuslice_common.nkeys import KeyPair, Role
from tests.deploy.kustomize import render
from tests.kubeapi import FakeApiServer

SECRETS = "/api/v1/namespaces/gpuslice/secrets"
WEBHOOKS = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
ROOT = Path(__file__).resolve().parents[1]
NOW = datetime(2030, 1, 1, tzinfo=UTC)


@pytest.fixture
def api(kube_api_server: FakeApiServer) -> Iterator[k8s.ApiClient]:
    kube_api_server.keep(SECRETS)
    kube_api_server.keep(WEBHOOKS)
    configuration = k8s.Configuration()
    configuration.host = kube_api_server.host
    with k8s.ApiClient(configuration) as client:
        yield client


def stored(server: FakeApiServer, name: str) -> dict[str, bytes]:
    secret = server.objects[f"{SECRETS}/{name}"]
    return {k: base64.b64decode(v) for k, v in secret["data"].items()}


def writes(server: FakeApiServer) -> list[tuple[str, str]]:
    return [(r.method, r.path) for r in server.requests if r.method in ("POST", "PUT", "PATCH")]


# ---------------------------------------------------------------- credentials


def credential_keys_the_manifests_read() -> set[str]:
    keys = set()
    for path in (ROOT / "k8s").rglob("*.yaml"):
        text = path.read_text()
        keys |= set(re.findall(r"name: gpuslice-credentials, key: ([a-z0-9-]+)", text))
    return keys


def test_every_key_the_manifests_read_is_made() -> None:
    assert credential_keys_the_manifests_read() == set(KEYS)


def test_the_credentials_are_made_from_nothing(
    kube_api_server: FakeApiServer, api: k8s.ApiClient
) -> None:
    assert ensure_credentials(api) == sorted(KEYS)
    data = stored(kube_api_server, CREDENTIALS)
    assert set(data) == set(KEYS)
    passwords = [v for k, v in data.items() if not k.startswith("nats-callout-")]
    assert all(re.fullmatch(rb"[0-9a-f]{48}", p) for p in passwords)
    assert len(set(passwords)) == len(passwords)
    pair = KeyPair.from_seed(data["nats-callout-seed"].decode(), Role.ACCOUNT)
    assert data["nats-callout-issuer"].decode() == pair.public_key
    labels = kube_api_server.objects[f"{SECRETS}/{CREDENTIALS}"]["metadata"]["labels"]
    assert labels == {MANAGED_BY: MANAGER}


def test_a_second_run_changes_nothing(kube_api_server: FakeApiServer, api: k8s.ApiClient) -> None:
    ensure_credentials(api)
    before = stored(kube_api_server, CREDENTIALS)
    count = len(writes(kube_api_server))
    assert ensure_credentials(api) == []
    assert len(writes(kube_api_server)) == count
    assert stored(kube_api_server, CREDENTIALS) == before


def test_keys_an_operator_set_are_kept_and_only_missing_ones_added(
    kube_api_server: FakeApiServer, api: k8s.ApiClient
) -> None:
    seed = KeyPair.generate(Role.ACCOUNT)
    kube_api_server.put(
        SECRETS,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": CREDENTIALS, "namespace": "gpuslice"},
            "data": {
                "nats-admin": base64.b64encode(b"chosen-by-hand").decode(),
                "nats-callout-seed": base64.b64encode(seed.seed.encode()).decode(),
            },
        },
    )
    added = ensure_credentials(api)
    assert "nats-admin" not in added
    assert "nats-callout-seed" not in added
    data = stored(kube_api_server, CREDENTIALS)
    assert data["nats-admin"] == b"chosen-by-hand"
    assert data["nats-callout-seed"].decode() == seed.seed
    # the issuer is the seed's own public key, not a new pair's
    assert data["nats-callout-issuer"].decode() == seed.public_key
    assert set(data) == set(KEYS)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"nats-callout-issuer": "ABC"}, "has nats-callout-issuer but no nats-callout-seed"),
        ({"nats-callout-seed": "SAnotaseed"}, "nats-callout-seed is not an account seed"),
        ({"nats-admin": "%%%"}, "key nats-admin is not base64"),
    ],
)
def test_a_credentials_secret_that_cannot_be_completed_is_refused(
    kube_api_server: FakeApiServer, api: k8s.ApiClient, data: dict[str, str], message: str
) -> None:
    encoded = {
        k: v if v == "%%%" else base64.b64encode(v.encode()).decode() for k, v in data.items()
    }
    kube_api_server.put(SECRETS, {"metadata": {"name": CREDENTIALS}, "data": encoded})
    with pytest.raises(InstallError, match=message):
        ensure_credentials(api)
    assert writes(kube_api_server) == []


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (b"", "empty"),  # Redis: `user scheduler on >` and `masterauth` with nothing
        (b"x1y2z3", "shorter than 12"),
        (b"secret-value-long\n", "whitespace"),  # kubectl --from-file keeps the newline
        (b"pw1234567890 resetkeys ~* +@all", "whitespace"),  # a config line of its own
        (b"pw1234567890\nuser default on nopass", "whitespace"),
        (b"pass/word@evil:6379", "'/'"),  # redis://scheduler:$(PASSWORD)@host: another host
        (b"pass%41word1234", "'%'"),
        (b"pass\x1bword1234", "a control character"),
    ],
)
def test_a_password_an_operator_set_that_is_unsafe_is_refused_by_key_not_shown(
    kube_api_server: FakeApiServer, api: k8s.ApiClient, value: bytes, why: str
) -> None:
    """The passwords go into Redis's and NATS's configuration files and into
    URLs: one that would break them, or change what they say, is refused
    naming its key (never its value) and nothing is written."""
    encoded = {"redis-scheduler": base64.b64encode(value).decode()}
    kube_api_server.put(SECRETS, {"metadata": {"name": CREDENTIALS}, "data": encoded})
    with pytest.raises(InstallError, match="redis-scheduler") as raised:
        ensure_credentials(api)
    assert why in str(raised.value)
    if value:
        assert value.decode(errors="replace") not in str(raised.value)
    assert writes(kube_api_server) == []


def test_generated_passwords_are_long_and_safe_in_urls_and_config_files(
    kube_api_server: FakeApiServer, api: k8s.ApiClient
) -> None:
    ensure_credentials(api)
    data = stored(kube_api_server, CREDENTIALS)
    for key in KEYS:
        if key.startswith("nats-callout"):
            continue
        assert re.fullmatch(rb"[0-9a-f]{48}", data[key]), key  # 192 random bits


def test_the_command_reports_what_it_added_and_fails_cleanly(
    kube_api_server: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kube_api_server.keep(SECRETS)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": kube_api_server.host}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    runner = CliRunner()
    first = runner.invoke(install, ["secrets"])
    assert first.exit_code == 0, first.output
    assert "added nats-admin" in first.output
    again = runner.invoke(install, ["secrets"])
    assert again.exit_code == 0
    assert "nothing changed" in again.output
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    failed = runner.invoke(install, ["secrets"])
    assert failed.exit_code == 1
    assert "error: cannot load Kubernetes credentials from kubeconfig" in failed.output
    assert "Traceback" not in failed.output


# ---------------------------------------------------------------- the webhook's certificate


@pytest.fixture
def webhook_configuration(kube_api_server: FakeApiServer) -> None:
    """The MutatingWebhookConfiguration as k8s/without-cert-manager applies it."""
    build = render(ROOT / "overlays" / "without-cert-manager")
    (config,) = [o for o in build if o["kind"] == "MutatingWebhookConfiguration"]
    kube_api_server.keep(WEBHOOKS)
    kube_api_server.put(WEBHOOKS, config)


def bundle(server: FakeApiServer) -> list[x509.Certificate]:
    config = server.objects[f"{WEBHOOKS}/gpuslice"]
    (encoded,) = {hook["clientConfig"]["caBundle"] for hook in config["webhooks"]}
    return x509.load_pem_x509_certificates(base64.b64decode(encoded))


def serving(server: FakeApiServer) -> x509.Certificate:
    return x509.load_pem_x509_certificate(stored(server, "gpuslice-webhook-tls")["tls.crt"])


def trusted(server: FakeApiServer) -> bool:
    """Whether the API server, with its caBundle, trusts what the webhook serves."""
    cert = serving(server)
    for ca in bundle(server):
        try:
            cert.verify_directly_issued_by(ca)
        except Exception:
            continue
        return True
    return False


@pytest.mark.usefixtures("webhook_configuration")
def test_the_certificate_is_made_from_nothing_and_trusted(
    kube_api_server: FakeApiServer, api: k8s.ApiClient
) -> None:
    outcome = ensure_webhook_cert(api, now=NOW)
    assert len(outcome.actions) == 3
    cert = serving(kube_api_server)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sorted(names.get_values_for_type(x509.DNSName)) == sorted(WebhookTarget().dns_names)
    assert cert.not_valid_after_utc == NOW + CertPolicy().validity
    assert trusted(kube_api_server)
    tls = kube_api_server.objects[f"{SECRETS}/gpuslice-webhook-tls"]
    assert tls["type"] == "kubernetes.io/tls"
    assert tls["metadata"]["labels"] == {MANAGED_BY: MANAGER}
    # the CA's key stays in the cluster, in a Secret of its own, not beside the serving pair
    assert "ca.key" not in stored(kube_api_server, "gpuslice-webhook-tls")
    assert set(stored(kube_api_server, "gpuslice-webhook-ca")) == {
        "tls.crt",
        "tls.key",
        "previous.crt",
    }


@pytest.mark.usefixtures("webhook_configuration")
def test_a_second_run_before_the_renewal_window_changes_nothing(
    kube_api_server: FakeApiServer, api: k8s.ApiClient
) -> None:
    ensure_webhook_cert(api, now=NOW)
    count = len(writes(kube_api_server))
    outcome = ensure_webhook_cert(api, now=NOW + timedelta(days=59))
    assert outcome.actions == []
    assert len(writes(kube_api_server)) == count


@pytest.mark.usefixtures("webhook_configuration")
def test_the_certificate_is_renewed_near_expiry_by_the_same_ca(
    kube_api_server: FakeApiServer, api: k8s.ApiClient
) -> None:
    ensure_webhook_cert(api, now=NOW)
    first, ca = serving(kube_api_server), bundle(kube_api_server)
    later = NOW + timedelta(days=61)
    outcome = ensure_webhook_cert(api, now=later)
    assert len(outcome.actions) == 1
    assert outcome.actions[0].startswith("issued")
    renewed = serving(kube_api_server)
    assert renewed.serial_number != first.serial_number
    assert renewed.not_valid_after_utc == later + CertPolicy().validity
    # the caBundle did not change: the API server trusts the new certificate at once
    assert bundle(kube_api_server) == ca
    assert trusted(kube_api_server)


@pytest.mark.usefixtures("webhook_configuration")
def test_the_ca_is_rotated_before_it_expires_with_both_in_the_bundle(
    kube_api_server: FakeApiServer, api: k8s.ApiClient
) -> None:
    policy = CertPolicy()
    ensure_webhook_cert(api, now=NOW)
    (old_ca,) = bundle(kube_api_server)
    rotation = NOW + policy.ca_validity - policy.ca_renew_before + timedelta(days=1)
    ensure_webhook_cert(api, now=rotation)
    new_ca, kept = bundle(kube_api_server)
    assert kept == old_ca
    assert new_ca != old_ca
    assert trusted(kube_api_server)
    serving(kube_api_server).verify_directly_issued_by(new_ca)
    # once the old CA has expired it leaves the bundle
    ensure_webhook_cert(api, now=old_ca.not_valid_after_utc + timedelta(days=1))
    assert bundle(kube_api_server) == [new_ca]
    assert trusted(kube_api_server)


def put_tls(server: FakeApiServer, labels: dict[str, str], garbage: str = "") -> None:
    garbage = garbage or base64.b64encode(b"not a certificate").decode()
    server.put(
        SECRETS,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "kubernetes.io/tls",
            "metadata": {"name": "gpuslice-webhook-tls", "namespace": "gpuslice", "labels": labels},
            "data": {"tls.crt": garbage, "tls.key": garbage},
        },
    )


@pytest.mark.usefixtures("webhook_configuration")
def test_a_foreign_secret_is_refused_by_name_and_left_alone(
    kube_api_server: FakeApiServer, api: k8s.ApiClient
) -> None:
    put_tls(kube_api_server, {"owner": "someone-else"})
    before = kube_api_server.objects[f"{SECRETS}/gpuslice-webhook-tls"]
    with pytest.raises(InstallError, match="Secret gpuslice/gpuslice-webhook-tls was not made by"):
        ensure_webhook_cert(api, now=NOW)
    assert kube_api_server.objects[f"{SECRETS}/gpuslice-webhook-tls"] == before
    # nothing else written either: no CA of its own, the caBundle untouched
    assert writes(kube_api_server) == []


@pytest.mark.usefixtures("webhook_configuration")
def test_an_unreadable_secret_of_ours_is_reported_and_replaced(
    kube_api_server: FakeApiServer, api: k8s.ApiClient, capsys: pytest.CaptureFixture[str]
) -> None:
    put_tls(kube_api_server, {MANAGED_BY: MANAGER})
    ensure_webhook_cert(api, now=NOW)
    assert "Secret gpuslice/gpuslice-webhook-tls: cannot parse" in capsys.readouterr().err
    assert trusted(kube_api_server)


@pytest.mark.usefixtures("webhook_configuration")
def test_a_secret_of_ours_that_is_not_even_base64_is_replaced(
    kube_api_server: FakeApiServer, api: k8s.ApiClient, capsys: pytest.CaptureFixture[str]
) -> None:
    put_tls(kube_api_server, {MANAGED_BY: MANAGER}, garbage="%%%")
    ensure_webhook_cert(api, now=NOW)
    assert "key tls.crt is not base64: replacing it" in capsys.readouterr().err
    assert trusted(kube_api_server)


def test_without_the_webhook_configuration_the_run_fails_and_says_so(
    kube_api_server: FakeApiServer, api: k8s.ApiClient
) -> None:
    with pytest.raises(InstallError, match="MutatingWebhookConfiguration gpuslice not found"):
        ensure_webhook_cert(api, now=NOW)


def test_lifetimes_that_would_leave_a_gap_are_refused() -> None:
    with pytest.raises(ValueError, match="ca_renew_before"):
        CertPolicy(ca_renew_before=timedelta(days=10))


def test_an_api_server_that_does_not_answer_is_an_error_naming_the_step() -> None:
    configuration = k8s.Configuration()
    configuration.host = "http://127.0.0.1:9"  # discard: nothing listens
    configuration.retries = 0
    with (
        k8s.ApiClient(configuration) as client,
        pytest.raises(
            InstallError, match="reading Secret gpuslice/gpuslice-credentials: cannot reach"
        ),
    ):
        ensure_credentials(client)
