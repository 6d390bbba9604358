"""``gpuslice install``: the steps of an install that would otherwise be done by
hand, run by Jobs in the cluster (k8s/bootstrap.yaml, k8s/without-cert-manager/).

* ``gpuslice install secrets`` makes the Secret ``gpuslice-credentials`` with
  every password and key the manifests read, or adds the keys it lacks. A key
  already there is never changed, so the Job runs at every apply.
* ``gpuslice install webhook-cert`` keeps the webhook's certificate without
  cert-manager: a CA of gpuslice's own (its key in a Secret, so that renewals
  keep it and the ``caBundle`` stays valid), a serving certificate for the
  webhook Service's names, renewed within a window of its expiry, and the CA in
  the webhook configuration's ``caBundle``. The CA is replaced well before it
  expires; the old one stays in the ``caBundle`` while it is valid, so
  certificates it signed are trusted until they are replaced.

Both refuse to touch a Secret someone else made when it is not what they
expect: they name it and stop (the Job fails and says why).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import typer
import urllib3
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from gpuslice_common.nkeys import KeyPair, NkeyError, Role

install = typer.Typer(
    help="Install steps the cluster's Jobs run (k8s/): secrets, the webhook's certificate.",
    no_args_is_help=True,
    rich_markup_mode=None,
)

NAMESPACE = "gpuslice"
CREDENTIALS = "gpuslice-credentials"
# what gpuslice makes carries this label: only such objects may be replaced
MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "gpuslice-install"

# The passwords the manifests read from gpuslice-credentials (hex: some go into URLs).
PASSWORDS = (
    "nats-webhook",
    "nats-scheduler",
    "nats-inventory",
    "nats-auditor",
    "nats-admin",
    "nats-callout",
    "nats-route",
    "redis-scheduler",
    "redis-inventory",
    "redis-operator",
    "redis-probe",
    "redis-replica",
    "redis-sentinel",
    "redis-sentinel-client",
    "redis-cluster-admin",
)
CALLOUT_SEED = "nats-callout-seed"
CALLOUT_ISSUER = "nats-callout-issuer"
KEYS = (*PASSWORDS, CALLOUT_SEED, CALLOUT_ISSUER)


class InstallError(Exception):
    """What stops an install step, said for the operator."""


# ---------------------------------------------------------------- the API


def api_client_from_environment() -> k8s.ApiClient:
    """The pod's service account in a cluster, else the current kubeconfig context."""
    configuration = k8s.Configuration()
    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            source = "the in-cluster service account"
            k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        else:
            source = f"kubeconfig {os.environ.get('KUBECONFIG') or '~/.kube/config'}"
            k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=os.environ.get("KUBECONFIG") or "~/.kube/config",
                client_configuration=configuration,
            )
    except (ConfigException, OSError, ValueError, TypeError, KeyError) as error:
        detail = " ".join(str(error).split()) or type(error).__name__
        raise InstallError(f"cannot load Kubernetes credentials from {source}: {detail}") from None
    return k8s.ApiClient(configuration)


def _problem(error: ApiException) -> str:
    try:
        message = json.loads(error.body or "{}").get("message")
    except (ValueError, AttributeError):
        message = None
    return f"HTTP {error.status}: {message or error.reason}"


def _call(what: str, call: Callable[[], Any]) -> dict[str, Any] | None:
    """The object an API call answers, or None for 404; anything else an InstallError."""
    try:
        response = call()
    except ApiException as error:
        if error.status == 404:
            return None
        raise InstallError(f"{what}: {_problem(error)}") from None
    except (OSError, urllib3.exceptions.HTTPError) as error:
        detail = " ".join(str(error).split()) or type(error).__name__
        raise InstallError(f"{what}: cannot reach the API server ({detail})") from None
    body = json.loads(response.data or b"{}")
    if not isinstance(body, dict):
        raise InstallError(f"{what}: the API server answered {type(body).__name__}, not an object")
    return body


class Secrets:
    """Secrets of one namespace: read, create, replace (with its resourceVersion)."""

    def __init__(self, api: k8s.ApiClient, namespace: str) -> None:
        self.core = k8s.CoreV1Api(api)
        self.namespace = namespace

    def get(self, name: str) -> dict[str, Any] | None:
        return _call(
            f"reading Secret {self.namespace}/{name}",
            lambda: self.core.read_namespaced_secret(name, self.namespace, _preload_content=False),
        )

    def create(self, name: str, data: Mapping[str, bytes], kind: str = "Opaque") -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": kind,
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": {MANAGED_BY: MANAGER},
            },
            "data": _encoded(data),
        }
        _call(
            f"creating Secret {self.namespace}/{name}",
            lambda: self.core.create_namespaced_secret(
                self.namespace, cast(Any, body), _preload_content=False
            ),
        )

    def replace(self, secret: dict[str, Any], data: Mapping[str, bytes]) -> None:
        """``secret`` (as read) with ``data``: refused by the API server if it changed since."""
        name = secret["metadata"]["name"]
        body = {**secret, "data": _encoded(data)}
        _call(
            f"updating Secret {self.namespace}/{name}",
            lambda: self.core.replace_namespaced_secret(
                name, self.namespace, cast(Any, body), _preload_content=False
            ),
        )


def _encoded(data: Mapping[str, bytes]) -> dict[str, str]:
    return {key: base64.b64encode(value).decode() for key, value in sorted(data.items())}


def secret_data(secret: Mapping[str, Any]) -> dict[str, bytes]:
    """A Secret's data, decoded; a value that is not base64 is an InstallError."""
    name = secret.get("metadata", {}).get("name", "?")
    data = secret.get("data") or {}
    if not isinstance(data, dict):
        raise InstallError(f"Secret {name}: its data is not a mapping")
    decoded = {}
    for key, value in data.items():
        try:
            decoded[str(key)] = base64.b64decode(str(value), validate=True)
        except binascii.Error:
            raise InstallError(f"Secret {name}: key {key} is not base64") from None
    return decoded


def ours(secret: Mapping[str, Any]) -> bool:
    labels = secret.get("metadata", {}).get("labels") or {}
    return isinstance(labels, dict) and labels.get(MANAGED_BY) == MANAGER


# ---------------------------------------------------------------- credentials


MIN_PASSWORD = 12
# what a password may hold: it goes into URLs (redis://user:PASSWORD@host) and,
# substituted as it is, into Redis's and NATS's configuration files
_PASSWORD_CHARS = re.compile(rb"[A-Za-z0-9._~+=-]*")


def unsafe_password(value: bytes) -> str | None:
    """Why ``value`` cannot be used as a password as it is, or None. The
    answer never quotes the value."""
    if not value:
        return "it is empty"
    if len(value) < MIN_PASSWORD:
        return f"it is shorter than {MIN_PASSWORD} characters"
    if _PASSWORD_CHARS.fullmatch(value):
        return None
    if any(c in b" \t\r\n\v\f" for c in value):
        return "it holds whitespace, which ends a line or word of a configuration file"
    if any(c < 0x20 or c >= 0x7F for c in value):
        return "it holds a control character or a byte outside ASCII"
    bad = sorted({chr(c) for c in value if not _PASSWORD_CHARS.fullmatch(bytes([c]))})
    return (
        f"it holds {', '.join(repr(c) for c in bad)}, which a URL or a configuration "
        "file reads otherwise (use letters, digits and . _ ~ + = -)"
    )


def missing_credentials(present: Mapping[str, bytes]) -> dict[str, bytes]:
    """The keys ``present`` lacks, made up: hex passwords, and the auth callout's
    account key pair (its issuer derived from a seed already there). A password
    already there that :func:`unsafe_password` refuses is an InstallError
    naming its key: it is not changed, nor used."""
    for key in PASSWORDS:
        if key in present and (why := unsafe_password(present[key])):
            raise InstallError(
                f"Secret {CREDENTIALS}: key {key} is not a usable password: {why}; "
                f"set another, or remove the key to have one made"
            )
    made = {key: secrets.token_hex(24).encode() for key in PASSWORDS if key not in present}
    seed, issuer = present.get(CALLOUT_SEED), present.get(CALLOUT_ISSUER)
    if seed is None and issuer is not None:
        raise InstallError(
            f"Secret {CREDENTIALS} has {CALLOUT_ISSUER} but no {CALLOUT_SEED}: the issuer's "
            f"seed cannot be made up; remove {CALLOUT_ISSUER} to have a new pair made"
        )
    if seed is None:
        pair = KeyPair.generate(Role.ACCOUNT)
        made[CALLOUT_SEED] = pair.seed.encode()
        made[CALLOUT_ISSUER] = pair.public_key.encode()
        return made
    try:
        pair = KeyPair.from_seed(seed.decode("ascii", "replace"), Role.ACCOUNT)
    except NkeyError as error:
        raise InstallError(
            f"Secret {CREDENTIALS}: {CALLOUT_SEED} is not an account seed ({error})"
        ) from None
    if issuer is None:
        made[CALLOUT_ISSUER] = pair.public_key.encode()
    elif issuer.decode("ascii", "replace").strip() != pair.public_key:
        raise InstallError(
            f"Secret {CREDENTIALS}: {CALLOUT_ISSUER} is not the public key of {CALLOUT_SEED}"
        )
    return made


def ensure_credentials(api: k8s.ApiClient, namespace: str = NAMESPACE) -> list[str]:
    """Make ``gpuslice-credentials`` or add the keys it lacks; the keys added."""
    store = Secrets(api, namespace)
    secret = store.get(CREDENTIALS)
    if secret is None:
        made = missing_credentials({})
        store.create(CREDENTIALS, made)
        return sorted(made)
    present = secret_data(secret)
    made = missing_credentials(present)
    if made:
        store.replace(secret, {**present, **made})
    return sorted(made)


# ---------------------------------------------------------------- the webhook's certificate


@dataclass(frozen=True)
class CertPolicy:
    """Lifetimes: the serving certificate is renewed within ``renew_before`` of
    its expiry, the CA within ``ca_renew_before`` of its own, which must leave
    time for every serving certificate the old CA signed to be replaced."""

    validity: timedelta = timedelta(days=90)
    renew_before: timedelta = timedelta(days=30)
    ca_validity: timedelta = timedelta(days=5 * 365)
    ca_renew_before: timedelta = timedelta(days=365)

    def __post_init__(self) -> None:
        if not timedelta(0) < self.renew_before < self.validity:
            raise ValueError("renew_before must be positive and shorter than validity")
        if not self.validity < self.ca_renew_before < self.ca_validity:
            raise ValueError("ca_renew_before must lie between validity and ca_validity")


@dataclass(frozen=True)
class WebhookTarget:
    namespace: str = NAMESPACE
    service: str = "gpuslice-webhook"
    tls_secret: str = "gpuslice-webhook-tls"
    ca_secret: str = "gpuslice-webhook-ca"
    configuration: str = "gpuslice"

    @property
    def dns_names(self) -> list[str]:
        base = f"{self.service}.{self.namespace}.svc"
        return [base, f"{base}.cluster.local"]


@dataclass
class CertOutcome:
    actions: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Issued:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return self.key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def make_ca(now: datetime, policy: CertPolicy, namespace: str) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(f"gpuslice-webhook-ca {namespace} {now:%Y%m%d%H%M%S}")
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + policy.ca_validity)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issued(cert, key)


def make_serving(ca: Issued, names: list[str], now: datetime, policy: CertPolicy) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    not_after = min(now + policy.validity, ca.cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(names[0]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(not_after)
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, False, False, False, False),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False
        )
        .sign(ca.key, hashes.SHA256())
    )
    return Issued(cert, key)


def _load_pair(data: Mapping[str, bytes], where: str) -> Issued:
    """The certificate and EC key under tls.crt / tls.key; InstallError if unreadable."""
    try:
        cert = x509.load_pem_x509_certificate(data["tls.crt"])
        key = serialization.load_pem_private_key(data["tls.key"], password=None)
    except KeyError as missing:
        raise InstallError(f"{where}: no {missing.args[0]}") from None
    except (ValueError, TypeError) as error:
        raise InstallError(f"{where}: cannot parse its certificate or key ({error})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise InstallError(f"{where}: its key is not an EC key")
    if key.public_key().public_numbers() != cert.public_key().public_numbers():  # type: ignore[union-attr]
        raise InstallError(f"{where}: tls.key is not the key of tls.crt")
    return Issued(cert, key)


def _load_certs(pem: bytes) -> list[x509.Certificate]:
    try:
        return x509.load_pem_x509_certificates(pem) if pem.strip() else []
    except ValueError:
        return []


def _signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _san(cert: x509.Certificate) -> list[str]:
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return list(names.get_values_for_type(x509.DNSName))


def _read_managed(store: Secrets, name: str) -> tuple[dict[str, Any] | None, Issued | None]:
    """A Secret (None if absent) and its pair (None if ours and unreadable: to be
    replaced). A Secret that is not ours is never replaced: InstallError."""
    secret = store.get(name)
    if secret is None:
        return None, None
    where = f"Secret {store.namespace}/{name}"
    if not ours(secret):
        raise InstallError(
            f"{where} was not made by gpuslice (no label {MANAGED_BY}={MANAGER}) and is "
            "not replaced: delete it (for instance a certificate cert-manager made) to let "
            "gpuslice make its own"
        )
    try:
        return secret, _load_pair(secret_data(secret), where)
    except InstallError as error:
        typer.echo(f"{error}: replacing it", err=True)
        return secret, None


def _holds(secret: Mapping[str, Any] | None, data: Mapping[str, bytes]) -> bool:
    """Whether ``secret`` exists and holds exactly ``data`` (unreadable data does not)."""
    if secret is None:
        return False
    try:
        return secret_data(secret) == data
    except InstallError:
        return False


def _write(
    store: Secrets, name: str, secret: dict[str, Any] | None, data: dict[str, bytes]
) -> None:
    if secret is None:
        store.create(name, data, kind="kubernetes.io/tls")
    else:
        store.replace(secret, data)


def ensure_webhook_cert(
    api: k8s.ApiClient,
    now: datetime | None = None,
    policy: CertPolicy | None = None,
    target: WebhookTarget | None = None,
) -> CertOutcome:
    """Bring the CA, the serving certificate and the caBundle up to date. The
    caBundle is written before a serving certificate from a new CA, so the API
    server trusts each certificate the webhook may serve meanwhile."""
    now = now or datetime.now(UTC)
    policy = policy or CertPolicy()
    target = target or WebhookTarget()
    store = Secrets(api, target.namespace)
    outcome = CertOutcome()

    # both Secrets read, and refused if foreign, before anything is written
    ca_secret, ca = _read_managed(store, target.ca_secret)
    tls_secret, serving = _read_managed(store, target.tls_secret)
    # an unreadable CA is replaced outright: what it signed is replaced too
    previous = (
        _load_certs(secret_data(ca_secret).get("previous.crt", b"")) if ca and ca_secret else []
    )
    if ca is None or ca.cert.not_valid_after_utc - now <= policy.ca_renew_before:
        if ca is not None:
            previous = [ca.cert]
        ca = make_ca(now, policy, target.namespace)
        outcome.actions.append(f"made a new CA in Secret {target.namespace}/{target.ca_secret}")
    previous = [c for c in previous if c.not_valid_after_utc > now]
    ca_data = {
        "tls.crt": ca.cert_pem,
        "tls.key": ca.key_pem,
        "previous.crt": b"".join(c.public_bytes(serialization.Encoding.PEM) for c in previous),
    }
    if not _holds(ca_secret, ca_data):
        _write(store, target.ca_secret, ca_secret, ca_data)

    bundle = ca.cert_pem + ca_data["previous.crt"]
    if _patch_ca_bundle(api, target.configuration, bundle):
        outcome.actions.append(
            f"set the caBundle of MutatingWebhookConfiguration {target.configuration}"
        )

    if (
        serving is None
        or not _signed_by(serving.cert, ca.cert)
        or sorted(_san(serving.cert)) != sorted(target.dns_names)
        or serving.cert.not_valid_after_utc - now <= policy.renew_before
    ):
        serving = make_serving(ca, target.dns_names, now, policy)
        outcome.actions.append(
            f"issued a certificate for {', '.join(target.dns_names)} in Secret "
            f"{target.namespace}/{target.tls_secret}, valid until "
            f"{serving.cert.not_valid_after_utc:%Y-%m-%d}"
        )
    tls_data = {"tls.crt": serving.cert_pem, "tls.key": serving.key_pem, "ca.crt": ca.cert_pem}
    if not _holds(tls_secret, tls_data):
        _write(store, target.tls_secret, tls_secret, tls_data)
    return outcome


def _patch_ca_bundle(api: k8s.ApiClient, name: str, bundle: bytes) -> bool:
    """Every entry of the MutatingWebhookConfiguration trusts ``bundle``; whether it changed."""
    admission = k8s.AdmissionregistrationV1Api(api)
    what = f"MutatingWebhookConfiguration {name}"
    config = _call(
        f"reading {what}",
        lambda: admission.read_mutating_webhook_configuration(name, _preload_content=False),
    )
    if config is None:
        raise InstallError(f"{what} not found: apply k8s/ first (the Job retries)")
    encoded = base64.b64encode(bundle).decode()
    hooks = config.get("webhooks") or []
    changed = False
    for hook in hooks:
        client_config = hook.setdefault("clientConfig", {})
        if client_config.get("caBundle") != encoded:
            client_config["caBundle"] = encoded
            changed = True
    if changed:
        _call(
            f"updating {what}",
            lambda: admission.replace_mutating_webhook_configuration(
                name, cast(Any, config), _preload_content=False
            ),
        )
    return changed


# ---------------------------------------------------------------- commands


def _fail(error: InstallError) -> typer.Exit:
    typer.echo(f"error: {error}", err=True)
    return typer.Exit(1)


@install.command("secrets")
def secrets_command(
    namespace: str = typer.Option(NAMESPACE, help="the namespace gpuslice runs in"),
) -> None:
    """Make the Secret gpuslice-credentials, or add the keys it lacks (never changes one)."""
    try:
        added = ensure_credentials(api_client_from_environment(), namespace)
    except InstallError as error:
        raise _fail(error) from None
    if added:
        typer.echo(f"Secret {namespace}/{CREDENTIALS}: added {', '.join(added)}")
    else:
        typer.echo(f"Secret {namespace}/{CREDENTIALS}: every key is there, nothing changed")


@install.command("webhook-cert")
def webhook_cert_command(
    namespace: str = typer.Option(NAMESPACE, help="the namespace gpuslice runs in"),
    service: str = typer.Option("gpuslice-webhook", help="the webhook's Service"),
    configuration: str = typer.Option(
        "gpuslice", help="the MutatingWebhookConfiguration whose caBundle to set"
    ),
) -> None:
    """Keep the webhook's CA, certificate and caBundle up to date (without cert-manager)."""
    target = WebhookTarget(namespace=namespace, service=service, configuration=configuration)
    try:
        outcome = ensure_webhook_cert(api_client_from_environment(), target=target)
    except InstallError as error:
        raise _fail(error) from None
    for action in outcome.actions:
        typer.echo(action)
    if not outcome.actions:
        typer.echo("the webhook's certificate and caBundle are up to date, nothing changed")
