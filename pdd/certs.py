"""`pdd certs`: a cluster's certificates and credentials, made once per deployment.

    DIR/ca.pem, ca.key            the cluster's own CA (keep ca.key off the serving hosts)
    DIR/kv/<instance>.pem, .key   one per instance: decoders serve the KV plane with theirs,
                                  prefill presents its own (mutual TLS); the certificate names
                                  the instance (DNS SAN) and its role (OU)
    DIR/nats/<dc>.pem, .key       the scheduler's site serves its NATS leafnode port with its
                                  certificate; every other site presents its own when it joins;
                                  a clustered site's servers route to each other with it (it
                                  names their `control_plane.hosts`)
    DIR/credentials.json          NATS passwords per user (each model instance by its id;
                                  gateway, scheduler, wanlink, operator) and for the links
                                  between servers; the Redis password

`pdd up` makes a throwaway set for the one-host demo on first start; a real deployment runs
`pdd certs --config cluster.yaml --out secrets/ --host nats-a.example.com ...` once and copies
to each site what it needs (docs/deploy.md). Python's `cryptography` makes the keys: EC P-256.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import secrets
from pathlib import Path
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdd.servers import sentinel_watch
from shared.config import ClusterConfig
from shared.security import NATS_USERS

VALID_DAYS = 825
LOCAL_NAMES = ("localhost", "127.0.0.1")


def _name(common: str, unit: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdd"),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, unit),
            x509.NameAttribute(NameOID.COMMON_NAME, common),
        ]
    )


def _write(path: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    key_path = path.with_suffix(".key")
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    key_path.chmod(0o600)
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _sans(names: list[str]) -> x509.SubjectAlternativeName:
    out: list[x509.GeneralName] = []
    for n in dict.fromkeys(names):
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            out.append(x509.DNSName(n))
    return x509.SubjectAlternativeName(out)


_CA_USAGE = x509.KeyUsage(
    digital_signature=False,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=True,
    crl_sign=True,
    encipher_only=False,
    decipher_only=False,
)


class CertificateAuthority:
    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        self.key, self.cert = key, cert

    @classmethod
    def create(cls, cluster: str) -> CertificateAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        name = _name(f"pdd cluster CA {cluster}", "ca")
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_CA_USAGE, critical=True)
            .sign(key, hashes.SHA256())
        )
        return cls(key, cert)

    def issue(self, common: str, unit: str, names: list[str]) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        """A certificate for serving and for presenting as a client, valid for `names`."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        usage = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(common, unit))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(_sans(names), critical=False)
            .add_extension(usage, critical=False)
            .sign(self.key, hashes.SHA256())
        )
        return key, cert


def make_secrets(cfg: ClusterConfig, out: Path, hosts: tuple[str, ...] = ()) -> Path:
    """Every certificate and credential `cfg` needs, into `out` (which must not hold a set yet)."""
    out = Path(out)
    if (out / "ca.pem").exists():
        raise FileExistsError(f"{out} already holds a CA; refusing to overwrite it")
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)
    ca = CertificateAuthority.create(out.name)
    _write(out / "ca.pem", ca.key, ca.cert)
    for inst in cfg.instances:
        _write(out / "kv" / f"{inst.id}.pem", *ca.issue(inst.id, inst.role, [inst.id, *LOCAL_NAMES, *hosts]))
    for dc in cfg.datacenters:
        routes = [cfg.control_plane.hosts.get(s.name, "") for s in cfg.nats_servers(dc.name)]
        names = [*LOCAL_NAMES, *hosts, *filter(None, routes)]  # a route checks the name it dialed
        _write(out / "nats" / f"{dc.name}.pem", *ca.issue(f"nats-{dc.name}", "nats", names))
    creds = {
        "nats": {u: secrets.token_urlsafe(18) for u in (*NATS_USERS, *(i.id for i in cfg.instances), "leaf", "route")},
        "redis": secrets.token_urlsafe(18),
        "index_key": secrets.token_hex(32),
    }
    path = out / "credentials.json"
    path.write_text(json.dumps(creds, indent=2))
    path.chmod(0o600)
    return out


def write_server_configs(cfg: ClusterConfig, out: Path) -> list[Path]:
    """Each NATS server's config and Redis's (`redis_configs`) beside the secrets, for servers
    run outside `pdd up` (containers, a real site). File paths inside are where the config says
    the secrets are mounted (`secrets_dir`), else `out`."""
    from pdd.natsconf import server_conf
    from shared.security import Secrets

    secrets, mount = Secrets(out), Path(cfg.secrets_dir) if cfg.secrets_dir else None
    paths = []
    for dc in cfg.datacenters:
        for server in cfg.nats_servers(dc.name):
            path = out / f"{server.name}.conf"
            path.write_text(server_conf(cfg, dc, secrets, mount, server))
            paths.append(path)
    for name, text in redis_configs(cfg, secrets.redis_password).items():
        path = out / name
        path.write_text(text)
        paths.append(path)
    for p in paths:
        p.chmod(0o600)
    return paths


def redis_configs(cfg: ClusterConfig, password: str) -> dict[str, str]:
    """File name -> text: redis.conf (the primary's) and, when Redis is replicated, each replica's
    `redis-<k>.conf` and each Sentinel's `sentinel-<k>.conf`. Each member announces the name the
    others reach it by (the primary its `redis_url` host, the others their own names, as their
    Services are called), not the address it sees: a failover hands those names on."""
    plane = cfg.control_plane
    own = [f"requirepass {password}", 'save ""', "appendonly no"]
    confs = {"redis.conf": own}
    if plane.redis_replicas or plane.sentinels:
        url = urlsplit(cfg.redis_url)
        host, port = url.hostname or "127.0.0.1", url.port or 6379
        member = [*own, f"masterauth {password}"]  # a Sentinel may make any member another's replica
        confs["redis.conf"] = [*member, f"replica-announce-ip {host}", f"replica-announce-port {port}"]
        for name in plane.replica_names:
            listen = f"port {plane.ports.get(name) or 6379}"
            confs[f"{name}.conf"] = [*member, listen, f"replica-announce-ip {name}", f"replicaof {host} {port}"]
        quorum = plane.sentinels // 2 + 1
        watch = sentinel_watch(plane.redis_master, host, port, quorum, plane.sentinel_down_ms, password)
        for name in plane.sentinel_names:
            confs[f"{name}.conf"] = [
                f"port {plane.ports.get(name) or 26379}",
                "sentinel resolve-hostnames yes",  # before `monitor`, which names the primary by host
                "sentinel announce-hostnames yes",
                f"sentinel announce-ip {name}",
                *watch,
            ]
    return {name: "\n".join(lines) + "\n" for name, lines in confs.items()}


def main(args) -> int:
    from shared.config import load_config

    cfg = load_config(args.config)
    out = make_secrets(cfg, Path(args.out), tuple(args.host))
    print(f"pdd certs: wrote the cluster CA, KV and NATS certificates and credentials to {out}")
    if args.server_configs:
        for path in write_server_configs(cfg, out):
            print(f"pdd certs: wrote {path}")
    return 0
