"""What a process needs of the cluster's secrets (made by `pdd certs`, pdd/certs.py).

`pdd certs --out DIR` writes one bundle per process, each a folder laid out alike:

    DIR/<instance id>/   its KV certificate and key, the CA, its NATS seed, the index key
    DIR/gateway/         its NATS seed and Redis login
    DIR/scheduler/       its NATS seed, Redis login and the index key
    DIR/wanlink/         its NATS seed
    DIR/operator/        the `operator` NATS seed and the operator's Redis login (`default`):
                         `pdd status`, `pdd wan` and the tests; it belongs on no serving host
    DIR/site-<dc>/       what the site's NATS servers (and, in the scheduler's site, Redis) need:
                         the site's certificate, its users' public NATS keys, the link passwords,
                         the Redis users' password hashes and the pin of each site that joins it

A process reads only the bundle `secrets_dir` names: a container mounts its own there, and
`pdd up` points each child at its own (pdd/launcher.py). `Secrets(DIR)` reads every bundle as
one, for whoever holds the whole set: the launcher on one host, the tests, the machine that ran
`pdd certs`. A set made before bundles (one credentials.json) still reads as one bundle.

- NATS: a user per model instance (its id) and per control-plane role, each an NKEY (an Ed25519
  key pair: the process signs the server's nonce with its seed; the servers hold only the public
  key, so a site's server host gives away no login); the servers give each only the subjects it
  uses (pdd/natsconf.py), so for example main-decode cannot submit requests to the scheduler,
  read another decoder's tasks or report as another. Only the links between servers (`leaf`,
  `route`) log in with passwords. A set from before NKEYs (passwords) still logs in.
- KV plane: mutual TLS. A decoder serves with its instance certificate and accepts only a
  peer whose certificate the cluster CA signed for a prefill instance (OU=prefill); prefill
  checks that the decoder it reached is the instance the scheduler named (its certificate's
  DNS name), whatever address the connection went through (the WAN emulator, a NAT).
- Redis: a login per role (pdd/redisconf.py gives each only its commands and keys); model
  instances have none. Redis stays inside the scheduler's datacenter.

Only Python's `ssl` here; minting keys needs `cryptography` and lives in pdd/certs.py.
"""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from shared.config import ClusterConfig, ConfigError

NATS_USERS = ("gateway", "scheduler", "wanlink", "operator")  # beside one per model instance, by its id
CONTROL_BUNDLES = ("gateway", "scheduler", "wanlink")  # one bundle per role, shared by its replicas
OPERATOR = "operator"
CREDENTIALS = "credentials.json"
_BY_USER = ("nats", "nkeys", "nkey_users")  # credentials.json's maps of user -> secret, merged across bundles


def bundle_name(role: str, instance: str | None = None) -> str:
    """The bundle of a process: a model instance's is its id, a control-plane process's its role."""
    return role if role in CONTROL_BUNDLES else instance or role


def site_bundle(dc: str) -> str:
    return f"site-{dc}"


@dataclass(frozen=True)
class Secrets:
    directory: Path

    @classmethod
    def of(cls, cfg: ClusterConfig) -> Secrets | None:
        """The config's secrets, or None when it names none (a cluster run without security)."""
        if not cfg.secrets_dir:
            return None
        secrets = cls(Path(cfg.secrets_dir))
        if not (secrets.directory / CREDENTIALS).exists() and not secrets._bundles():
            raise ConfigError(
                f"secrets_dir {secrets.directory} holds no {CREDENTIALS} and no bundles: run `pdd certs`"
                " and mount the process's own bundle there"
            )
        return secrets

    def bundle(self, name: str) -> Secrets:
        """One process's bundle of the whole set; a single bundle (or a set from before bundles) is its own."""
        inner = self.directory / name
        if (inner / CREDENTIALS).exists():
            return Secrets(inner)
        if self._bundles():  # a whole set without it: never hand out the whole set instead
            raise self._missing(f"bundle {name!r}")
        return self

    def _bundles(self) -> list[Secrets]:
        """The bundles under a whole set (none under a bundle), the operator's last: the whole
        set logs in to Redis as the operator."""
        if (self.directory / CREDENTIALS).exists() or not self.directory.is_dir():
            return []
        found = sorted(d for d in self.directory.iterdir() if (d / CREDENTIALS).is_file())
        return sorted((Secrets(d) for d in found), key=lambda s: s.directory.name == OPERATOR)

    @cached_property
    def _credentials(self) -> dict:
        own = self.directory / CREDENTIALS
        if own.exists():
            return json.loads(own.read_text())
        merged: dict = {}
        for bundle in self._bundles():
            creds = bundle._credentials
            merged = merged | creds | {k: merged.get(k, {}) | creds[k] for k in _BY_USER if k in creds}
        return merged

    @property
    def ca(self) -> Path:
        return self.directory / "ca.pem"

    def _missing(self, what: str) -> ConfigError:
        return ConfigError(
            f"{self.directory} holds no {what}: not this process's to have, or a set made for another"
            " config or before it was needed; run `pdd certs` again"
        )

    def nats_password(self, user: str) -> str:
        """The password of a link between servers (`leaf`, `route`), or of a user in a set from
        before NKEYs."""
        try:
            return self._credentials["nats"][user]
        except KeyError:
            raise self._missing(f"password of the NATS user {user!r}") from None

    def nats_login(self, user: str) -> dict[str, str]:
        """nats.connect's arguments to log in as `user`: its NKEY seed (a set from before NKEYs:
        its password)."""
        seed = self._credentials.get("nkeys", {}).get(user)
        return {"nkeys_seed_str": seed} if seed else {"user": user, "password": self.nats_password(user)}

    def nats_public_key(self, user: str) -> str | None:
        """The public NKEY the site's servers know `user` by; None in a set from before NKEYs."""
        return self._credentials.get("nkey_users", {}).get(user)

    @property
    def route_password(self) -> str:
        """Between the NATS servers of one site (a cluster); a set made before clusters: the leaf's."""
        nats = self._credentials["nats"]
        return nats.get("route") or nats["leaf"]

    @property
    def redis_user(self) -> str:
        login = self._credentials.get("redis")
        if login is None:
            raise self._missing("Redis login")
        return "default" if isinstance(login, str) else login["user"]  # a set from before ACL users

    @property
    def redis_password(self) -> str:
        login = self._credentials.get("redis")
        if login is None:
            raise self._missing("Redis login")
        return login if isinstance(login, str) else login["password"]

    @property
    def redis_users(self) -> dict[str, str]:
        """User -> SHA-256 of its password (hex): what a site's Redis servers check logins against."""
        try:
            return self._credentials["redis_users"]
        except KeyError:
            raise self._missing("Redis users") from None

    @property
    def leaf_pins(self) -> list[str]:
        """SHA-256 (hex) of the public key of each other site's NATS certificate: only those join."""
        return self._credentials.get("leaf_pins", [])

    @property
    def index_key(self) -> bytes:
        """Keys the prefix index's block hashes (shared/prefix_hash.py)."""
        return bytes.fromhex(self._credentials.get("index_key", ""))

    def cert(self, kind: str, name: str) -> tuple[Path, Path]:
        """(certificate, key) of an instance (`kv`) or a site's NATS server (`nats`)."""
        base = self.directory / kind / name
        if not base.with_suffix(".pem").exists():  # the whole set: in the bundle that holds it
            held = [b for b in self._bundles() if (b.directory / kind / f"{name}.pem").exists()]
            base = held[0].directory / kind / name if held else base
        return base.with_suffix(".pem"), base.with_suffix(".key")

    def kv_server_context(self, instance_id: str) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(self.ca))
        ctx.load_cert_chain(*map(str, self.cert("kv", instance_id)))
        ctx.verify_mode = ssl.CERT_REQUIRED  # no certificate from the cluster CA, no connection
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        return ctx

    def kv_client_context(self, instance_id: str) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(self.ca))
        ctx.load_cert_chain(*map(str, self.cert("kv", instance_id)))
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        return ctx  # check_hostname: the caller passes the target instance id as server_hostname


def peer_unit(peercert: dict | None) -> str:
    """The OU (the role) of a TLS peer's certificate, "" when there is none."""
    for rdn in (peercert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "organizationalUnitName":
                return value
    return ""
