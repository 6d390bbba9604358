"""NATS's accounts and users as the cluster runs them, for the local stack.

:data:`AUTHORIZATION` is the ``accounts`` and ``authorization`` part of NATS's
configuration in k8s/nats.yaml (the ConfigMap's ``authorization.conf``, which
every member's ``nats.conf`` includes), word for word (a test holds the two alike):
two accounts, a static user with a password for each service, and the auth
callout for node agents and GPU containers. nats-server reads the passwords and
the callout's issuer from its environment (:meth:`NatsAuth.server_env`), as in
the cluster where they come from the Secret ``gpuslice-credentials``.

:class:`NatsAuth` holds one run's credentials: a fresh password per user and a
fresh account key pair for the callout.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from gpuslice_common.nkeys import KeyPair, Role

__all__ = [
    "AUTHORIZATION",
    "NODE_AGENT_AUDIENCE",
    "NODE_AGENT_NAMESPACE",
    "NODE_AGENT_SERVICE_ACCOUNT",
    "USERS",
    "NatsAuth",
]

# the users that log in with a password (auth_users); the callout is the inventory's second one
USERS = ("webhook", "scheduler", "inventory", "auditor", "admin", "callout")
# what a node agent's projected token is for, and whose it is (k8s/deviceplugin.yaml)
NODE_AGENT_AUDIENCE = "gpuslice-nats"
NODE_AGENT_NAMESPACE = "gpuslice"
NODE_AGENT_SERVICE_ACCOUNT = "gpuslice-deviceplugin"

AUTHORIZATION = """# Two accounts. AUTH holds only the auth callout's own user. GPUSLICE holds
# the services, static users with passwords; node agents and GPU containers
# have no password here: nats-server asks the auth callout (in the
# inventory) about each of them, and the callout places them in GPUSLICE
# with permissions for their own node or pod only (docs/architecture.md,
# "Who may do what").
accounts {
  AUTH {
    users: [
      # answers $SYS.REQ.USER.AUTH; the server's reply inbox is $SYS._INBOX
      { user: callout, password: $NATS_CALLOUT_PASSWORD,
        permissions: { publish: ["$SYS._INBOX.>"], subscribe: ["$SYS.REQ.USER.AUTH"] } }
    ]
  }
  GPUSLICE {
    jetstream: enabled
    users: [
      # Each event type has one publisher but two (alloc.failed: the extender for
      # placements, the inventory for allocations a node reports;
      # alloc.released: the inventory as pods end, the extender for a
      # reservation of an ended pod that stood in a pending pod's way); no
      # service may create, change, delete or purge the audit stream.
      # the webhook: admission events
      { user: webhook, password: $NATS_WEBHOOK_PASSWORD,
        permissions: { publish: ["gpuslice.events.pod.admitted", "gpuslice.events.pod.denied"],
                       subscribe: ["_INBOX.>"] } }
      # the extender: placement events
      { user: scheduler, password: $NATS_SCHEDULER_PASSWORD,
        permissions: { publish: ["gpuslice.events.alloc.reserved", "gpuslice.events.alloc.bound",
                                 "gpuslice.events.alloc.failed",
                                 "gpuslice.events.alloc.released",
                                 "gpuslice.events.alloc.preempted"],
                       subscribe: ["_INBOX.>"] } }
      # the inventory: reads inventories, node agents' requests (and
      # answers them in the node's own inbox: never on a subject the
      # requester names elsewhere), telemetry and pod ends; publishes
      # allocations, releases and node agents' enforcement; checks the audit stream and reads it
      { user: inventory, password: $NATS_INVENTORY_PASSWORD,
        permissions: { publish: ["gpuslice.events.alloc.allocated",
                                 "gpuslice.events.alloc.released",
                                 "gpuslice.events.alloc.failed",
                                 "gpuslice.events.enforce.*",
                                 "$JS.API.STREAM.INFO.gpuslice_audit",
                                 "$JS.API.CONSUMER.CREATE.gpuslice_audit",
                                 "$JS.API.CONSUMER.CREATE.gpuslice_audit.>",
                                 "$JS.API.CONSUMER.INFO.gpuslice_audit.*",
                                 "$JS.API.CONSUMER.DELETE.gpuslice_audit.*",
                                 "$JS.FC.gpuslice_audit.>", "_INBOX.>"],
                       subscribe: ["gpuslice.inventory.*", "gpuslice.node.*.>",
                                   "gpuslice.telemetry.*.*", "gpuslice.pods.ended", "_INBOX.>"] } }
      # operators and auditors: read the audit stream through consumers of
      # their own (an ordered consumer answers JetStream's flow control on $JS.FC)
      { user: auditor, password: $NATS_AUDITOR_PASSWORD,
        permissions: { publish: ["$JS.API.STREAM.INFO.gpuslice_audit",
                                 "$JS.API.CONSUMER.CREATE.gpuslice_audit",
                                 "$JS.API.CONSUMER.CREATE.gpuslice_audit.>",
                                 "$JS.API.CONSUMER.INFO.gpuslice_audit.*",
                                 "$JS.API.CONSUMER.DELETE.gpuslice_audit.*",
                                 "$JS.FC.gpuslice_audit.>"],
                       subscribe: ["_INBOX.>", "gpuslice.events.>"] } }
      # install and upgrade only (the gpuslice-audit-init Job): creates the
      # audit stream and sets its retention; it cannot delete or purge it
      { user: admin, password: $NATS_ADMIN_PASSWORD,
        permissions: { publish: ["$JS.API.INFO", "$JS.API.STREAM.INFO.gpuslice_audit",
                                 "$JS.API.STREAM.CREATE.gpuslice_audit",
                                 "$JS.API.STREAM.UPDATE.gpuslice_audit"],
                       subscribe: ["_INBOX.>"] } }
    ]
  }
}
authorization {
  auth_callout {
    # the public half of the callout's account key (nkey seed in the
    # inventory's GPUSLICE_CALLOUT_ISSUER_SEED)
    issuer: $NATS_CALLOUT_ISSUER
    account: AUTH
    # these users log in with their passwords, without the callout
    auth_users: [callout, webhook, scheduler, inventory, auditor, admin]
  }
}
"""


def _password() -> str:
    """48 hex digits (as docs/install.md makes them) starting with a letter:
    nats-server reads a variable from the environment as a configuration value,
    and digits alone would be a number."""
    while True:
        password = secrets.token_hex(24)
        if not password[0].isdigit():
            return password


@dataclass(frozen=True)
class NatsAuth:
    """One run's NATS credentials."""

    passwords: dict[str, str]  # by user
    issuer: KeyPair  # the callout's account key pair

    @classmethod
    def generate(cls) -> NatsAuth:
        return cls({user: _password() for user in USERS}, KeyPair.generate(Role.ACCOUNT))

    def server_env(self) -> dict[str, str]:
        """nats-server's environment, as k8s/nats.yaml gives it from the Secret."""
        env = {f"NATS_{user.upper()}_PASSWORD": pw for user, pw in self.passwords.items()}
        env["NATS_CALLOUT_ISSUER"] = self.issuer.public_key
        return env

    def client_env(self, user: str) -> dict[str, str]:
        """A service's environment for logging in as ``user``."""
        return {"GPUSLICE_NATS_USER": user, "GPUSLICE_NATS_PASSWORD": self.passwords[user]}
