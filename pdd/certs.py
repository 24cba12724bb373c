"""`pdd certs`: a cluster's certificates and credentials, made once per deployment, one bundle
per process (shared/security.py says what each holds and who reads it):

    DIR/ca.pem, ca.key              the cluster's own CA (ca.key is in no bundle: keep it off the
                                    serving hosts)
    DIR/<instance>/                 kv/<instance>.pem, .key: decoders serve the KV plane with
                                    theirs, prefill presents its own (mutual TLS); the certificate
                                    names the instance (DNS SAN) and its role (OU); ca.pem; its
                                    credentials.json: its NATS seed (NKEY), the prefix index's key
    DIR/gateway/, scheduler/,       credentials.json: the NATS seed of the role; the
        wanlink/                    gateway's and the scheduler's Redis login; the scheduler's
                                    index key
    DIR/operator/                   the `operator` NATS seed and the Redis `default` login: for
                                    an operator's machine only
    DIR/site-<dc>/                  nats/<dc>.pem, .key: the site's NATS servers serve (the
                                    scheduler's site's leafnode port) or present (every other
                                    site's, joining it) their certificate, and route with it (it
                                    names their `control_plane.hosts`); ca.pem; credentials.json:
                                    the public NKEYs of the site's NATS users (the server checks
                                    their signatures), the leaf and route passwords; in the
                                    scheduler's site
                                    the Redis users' password hashes, the replication login and
                                    the pins of the sites that join it

`pdd up` makes a throwaway set for the one-host demo on first start; a real deployment runs
`pdd certs --config cluster.yaml --out secrets/ --host nats-a.example.com ...` once and copies
to each host only its processes' bundles (docs/deploy.md). Python's `cryptography` makes the
TLS keys (EC P-256), `nkeys` the NATS users' Ed25519 seeds.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import json
import secrets
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import nkeys
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdd.natsconf import site_users
from pdd.redisconf import REDIS_USERS, sentinel_lines, server_lines
from pdd.servers import sentinel_watch
from shared.config import ClusterConfig
from shared.security import CONTROL_BUNDLES, CREDENTIALS, NATS_USERS, OPERATOR, Secrets, site_bundle

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


@dataclass(frozen=True)
class Passwords:
    """What `pdd certs` draws for a cluster: an NKEY seed per NATS user, a password per link
    between NATS servers and per Redis login, the prefix index's key."""

    nats: dict[str, str]  # the links: leaf, route
    nkeys: dict[str, str]  # user -> seed ("SU..."): the user signs the server's nonce with it
    redis: dict[str, str]
    index_key: str

    @classmethod
    def draw(cls, cfg: ClusterConfig) -> Passwords:
        new = lambda names: {n: secrets.token_urlsafe(18) for n in names}  # noqa: E731
        users = (*NATS_USERS, *(i.id for i in cfg.instances))
        seeds = {u: nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER).decode() for u in users}
        return cls(new(("leaf", "route")), seeds, new(REDIS_USERS), secrets.token_hex(32))

    def public_key(self, user: str) -> str:
        """What the servers know `user` by ("U..."): its seed's public half."""
        return nkeys.from_seed(bytearray(self.nkeys[user].encode())).public_key.decode()


def make_secrets(cfg: ClusterConfig, out: Path, hosts: tuple[str, ...] = ()) -> Path:
    """Every bundle `cfg` needs, into `out` (which must not hold a set yet)."""
    out = Path(out)
    if (out / "ca.pem").exists():
        raise FileExistsError(f"{out} already holds a CA; refusing to overwrite it")
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)
    ca = CertificateAuthority.create(out.name)
    _write(out / "ca.pem", ca.key, ca.cert)
    drawn = Passwords.draw(cfg)
    _process_bundles(cfg, out, ca, drawn, hosts)
    _site_bundles(cfg, out, ca, drawn, hosts)
    return out


def _process_bundles(
    cfg: ClusterConfig, out: Path, ca: CertificateAuthority, drawn: Passwords, hosts: tuple[str, ...]
) -> None:
    """Each instance's, each control-plane role's and the operator's bundle."""
    for inst in cfg.instances:
        _write(out / inst.id / "kv" / f"{inst.id}.pem", *ca.issue(inst.id, inst.role, [inst.id, *LOCAL_NAMES, *hosts]))
        _bundle(out / inst.id, ca, {"nkeys": {inst.id: drawn.nkeys[inst.id]}, "index_key": drawn.index_key})
    for role in CONTROL_BUNDLES:  # no TLS of their own: no certificate, no CA
        creds: dict = {"nkeys": {role: drawn.nkeys[role]}}
        if role != "wanlink":
            creds["redis"] = {"user": role, "password": drawn.redis[role]}
        _bundle(out / role, None, creds | ({"index_key": drawn.index_key} if role == "scheduler" else {}))
    operator = {"user": "default", "password": drawn.redis["default"]}
    _bundle(out / OPERATOR, ca, {"nkeys": {OPERATOR: drawn.nkeys[OPERATOR]}, "redis": operator})


def _site_bundles(
    cfg: ClusterConfig, out: Path, ca: CertificateAuthority, drawn: Passwords, hosts: tuple[str, ...]
) -> None:
    """Each site's servers' bundle: the site's certificate, its users' public NKEYs (no seed: a
    server host gives away no login) and the links' passwords; the scheduler's site's also the
    Redis logins' hashes, the replication login and the pins of the sites that join it."""
    certs = {}
    for dc in cfg.datacenters:
        routes = [cfg.control_plane.hosts.get(s.name, "") for s in cfg.nats_servers(dc.name)]
        names = [*LOCAL_NAMES, *hosts, *filter(None, routes)]  # a route checks the name it dialed
        certs[dc.name] = ca.issue(f"nats-{dc.name}", "nats", names)
        _write(out / site_bundle(dc.name) / "nats" / f"{dc.name}.pem", *certs[dc.name])
    for dc in cfg.datacenters:
        users = [*site_users(cfg, dc.name), OPERATOR]
        creds: dict = {"nats": dict(drawn.nats), "nkey_users": {u: drawn.public_key(u) for u in users}}
        if dc.name == cfg.control_dc:
            creds["redis"] = {"user": "replication", "password": drawn.redis["replication"]}
            creds["redis_users"] = {u: hashlib.sha256(p.encode()).hexdigest() for u, p in drawn.redis.items()}
            creds["leaf_pins"] = [public_key_pin(cert) for d, (_, cert) in certs.items() if d != dc.name]
        _bundle(out / site_bundle(dc.name), ca, creds)


def public_key_pin(cert: x509.Certificate) -> str:
    """What nats-server's `pinned_certs` lists: SHA-256 of the certificate's public key (DER), hex."""
    der = cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def _bundle(folder: Path, ca: CertificateAuthority | None, creds: dict) -> None:
    """A process's folder: its credentials and, when it speaks TLS, the CA's certificate."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    if ca is not None:
        (folder / "ca.pem").write_bytes(ca.cert.public_bytes(serialization.Encoding.PEM))
    path = folder / CREDENTIALS
    path.write_text(json.dumps(creds, indent=2))
    path.chmod(0o600)


def write_server_configs(cfg: ClusterConfig, out: Path) -> list[Path]:
    """Each NATS server's config and Redis's (`redis_configs`) into its site's bundle, for servers
    run outside `pdd up` (containers, a real site). File paths inside are where the config says
    the site's bundle is mounted (`secrets_dir`), else that bundle's folder."""
    from pdd.natsconf import server_conf

    paths = []
    for dc in cfg.datacenters:
        site = Secrets(out).bundle(site_bundle(dc.name))
        mount = Path(cfg.secrets_dir) if cfg.secrets_dir else None
        confs = {
            f"{server.name}.conf": server_conf(cfg, dc, site, mount, server) for server in cfg.nats_servers(dc.name)
        }
        confs |= redis_configs(cfg, site) if dc.name == cfg.control_dc else {}
        for name, text in confs.items():
            path = site.directory / name
            path.write_text(text)
            path.chmod(0o600)
            paths.append(path)
    return paths


def redis_configs(cfg: ClusterConfig, site: Secrets) -> dict[str, str]:
    """File name -> text: redis.conf (the primary's) and, when Redis is replicated, each replica's
    `redis-<k>.conf` and each Sentinel's `sentinel-<k>.conf`, each with the site's ACL users
    (pdd/redisconf.py; these servers are Redis 7, `%R~` read-only keys). Each member announces the
    name the others reach it by (the primary its `redis_url` host, the others their own names, as
    their Services are called), not the address it sees: a failover hands those names on."""
    plane = cfg.control_plane
    # a Sentinel may make any member another's replica: every one presents the replication login
    own = [*server_lines(site, selectors=True), 'save ""', "appendonly no"]
    confs = {"redis.conf": own}
    if plane.redis_replicas or plane.sentinels:
        url = urlsplit(cfg.redis_url)
        host, port = url.hostname or "127.0.0.1", url.port or 6379
        confs["redis.conf"] = [*own, f"replica-announce-ip {host}", f"replica-announce-port {port}"]
        for name in plane.replica_names:
            listen = f"port {plane.ports.get(name) or 6379}"
            confs[f"{name}.conf"] = [*own, listen, f"replica-announce-ip {name}", f"replicaof {host} {port}"]
        quorum = plane.sentinels // 2 + 1
        watch = sentinel_watch(plane.redis_master, host, port, quorum, plane.sentinel_down_ms, None)
        for name in plane.sentinel_names:
            confs[f"{name}.conf"] = [
                f"port {plane.ports.get(name) or 26379}",
                "sentinel resolve-hostnames yes",  # before `monitor`, which names the primary by host
                "sentinel announce-hostnames yes",
                f"sentinel announce-ip {name}",
                *watch,
                *sentinel_lines(site, plane.redis_master),
            ]
    return {name: "\n".join(lines) + "\n" for name, lines in confs.items()}


def main(args) -> int:
    from shared.config import load_config

    cfg = load_config(args.config)
    out = make_secrets(cfg, Path(args.out), tuple(args.host))
    print(f"pdd certs: wrote the cluster CA and one bundle per process to {out}")
    if args.server_configs:
        for path in write_server_configs(cfg, out):
            print(f"pdd certs: wrote {path}")
    return 0
