"""What a process needs of the cluster's secrets (made by `pdd certs`, pdd/certs.py).

- NATS: a user per model instance (its id) and per control-plane role, each with a password; the
  servers give each only the subjects it uses (pdd/natsconf.py), so for example main-decode
  cannot submit requests to the scheduler, read another decoder's tasks or report as another.
- KV plane: mutual TLS. A decoder serves with its instance certificate and accepts only a
  peer whose certificate the cluster CA signed for a prefill instance (OU=prefill); prefill
  checks that the decoder it reached is the instance the scheduler named (its certificate's
  DNS name), whatever address the connection went through (the WAN emulator, a NAT).
- Redis: a password (Redis stays inside the scheduler's datacenter).

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


@dataclass(frozen=True)
class Secrets:
    directory: Path

    @classmethod
    def of(cls, cfg: ClusterConfig) -> Secrets | None:
        """The config's secrets, or None when it names none (a cluster run without security)."""
        if not cfg.secrets_dir:
            return None
        directory = Path(cfg.secrets_dir)
        if not (directory / "credentials.json").exists():
            raise ConfigError(f"secrets_dir {directory} holds no credentials.json: run `pdd certs --out {directory}`")
        return cls(directory)

    @cached_property
    def _credentials(self) -> dict:
        return json.loads((self.directory / "credentials.json").read_text())

    @property
    def ca(self) -> Path:
        return self.directory / "ca.pem"

    def nats_password(self, user: str) -> str:
        try:
            return self._credentials["nats"][user]
        except KeyError:
            raise ConfigError(
                f"{self.directory / 'credentials.json'} has no NATS user {user!r} (made for another config,"
                " or before each instance had a user of its own): run `pdd certs` again"
            ) from None

    @property
    def route_password(self) -> str:
        """Between the NATS servers of one site (a cluster); a set made before clusters: the leaf's."""
        nats = self._credentials["nats"]
        return nats.get("route") or nats["leaf"]

    @property
    def redis_password(self) -> str:
        return self._credentials["redis"]

    @property
    def index_key(self) -> bytes:
        """Keys the prefix index's block hashes (shared/prefix_hash.py)."""
        return bytes.fromhex(self._credentials.get("index_key", ""))

    def cert(self, kind: str, name: str) -> tuple[Path, Path]:
        """(certificate, key) of an instance (`kv`) or a site's NATS server (`nats`)."""
        base = self.directory / kind / name
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
