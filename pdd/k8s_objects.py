"""The pieces every Kubernetes object of pdd/k8s.py is made of: names, the Deployment and Service
shapes, the Secret's files and how a pod mounts only its own bundle of them, security contexts
and probes."""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from urllib.parse import urlsplit

from shared.config import ClusterConfig, ConfigError, NatsServer
from shared.security import CREDENTIALS as CREDENTIALS_FILE

IMAGE = "pdd:local"  # the compose files' tag; Kubernetes would pull a `:latest` on every start
NATS_IMAGE, REDIS_IMAGE = "nats:2.10-alpine", "redis:7"
IMAGE_CONFIGS = PurePosixPath("/app/configs")  # the Dockerfile's WORKDIR /app
CONFIG_MAP, SECRET, API_KEYS = "pdd-config", "pdd-secrets", "pdd-api-keys"
PDD_UID, REDIS_UID, NATS_UID = 10001, 999, 65534  # the image's `pdd` user, redis:7's, nobody
# as pdd/certs.py names them inside a bundle
CREDENTIALS, REDIS_CONF, CA = PurePosixPath(CREDENTIALS_FILE), PurePosixPath("redis.conf"), PurePosixPath("ca.pem")
REQUESTS = {  # a starting point: an engine needs its model plus `kv_tokens` of KV in memory
    "engine": {"memory": "4Gi"},
    "gateway": {"cpu": "500m", "memory": "1Gi"},
    "scheduler": {"cpu": "500m", "memory": "512Mi"},
    "nats": {"cpu": "100m", "memory": "128Mi"},
    "redis": {"cpu": "100m", "memory": "256Mi"},
    "sentinel": {"cpu": "50m", "memory": "64Mi"},
}
DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")


def label(name: str, what: str) -> str:
    if not DNS_LABEL.fullmatch(name):
        raise ConfigError(f"{what} {name!r} is not a Kubernetes name (lowercase letters, digits, '-')")
    return name


def endpoint(url: str, what: str) -> tuple[str, int]:
    """(Service name, port) of a `scheme://name:port` URL: in-site servers are reached by Service."""
    parts = urlsplit(url)
    if not parts.hostname or not parts.port:
        raise ConfigError(f"{what} {url!r} must be scheme://service-name:port")
    return label(parts.hostname, what), parts.port


def meta(name: str, component: str) -> dict:
    return {"name": name, "labels": {"app.kubernetes.io/name": name, "app.kubernetes.io/component": component}}


def deployment(name: str, component: str, pod: dict, annotations: dict | None = None) -> dict:
    """One pod, replaced rather than rolled: two pods of one instance id must never run at once."""
    template = {"labels": meta(name, component)["labels"]} | ({"annotations": annotations} if annotations else {})
    pod = {"enableServiceLinks": False, **pod}  # no FOO_PORT=tcp://... variables beside PDD_PORT
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(name, component),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": {"app.kubernetes.io/name": name}},
            "template": {"metadata": template, "spec": pod},
        },
    }


def service(name: str, selector: dict, ports: dict[str, tuple[int, int | str]], exposed: bool) -> dict:
    """`ports`: name -> (port, container port). `exposed`: reached from outside the site."""
    spec = {"type": "LoadBalancer" if exposed else "ClusterIP", "selector": selector}
    spec["ports"] = [{"name": n, "port": p, "targetPort": t, "protocol": "TCP"} for n, (p, t) in ports.items()]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(name, selector["app.kubernetes.io/component"]),
        "spec": spec,
    }


def secret_key(path: PurePosixPath) -> str:
    """A file's key in the Secret: keys hold no '/', so md-0/kv/md-0.pem is md-0-kv-md-0.pem."""
    return str(path).replace("/", "-")


def server_conf_file(server: str) -> PurePosixPath:
    """The config `pdd certs --server-configs` writes for the server of that name."""
    return PurePosixPath(f"{server}.conf")


def kv_files(instance: str) -> list[PurePosixPath]:
    """An instance's certificate and key, in its bundle."""
    return [PurePosixPath("kv") / f"{instance}{suffix}" for suffix in (".pem", ".key")]


def nats_files(cfg: ClusterConfig, dc: str, servers: list[NatsServer] | None = None) -> list[PurePosixPath]:
    """The configs of `servers` (default: every one of the site's), the CA, the site's certificate:
    in the site's bundle."""
    confs = [server_conf_file(s.name) for s in servers or cfg.nats_servers(dc)]
    return [*confs, CA, *(PurePosixPath("nats") / f"{dc}{suffix}" for suffix in (".pem", ".key"))]


def secrets_volume(cfg: ClusterConfig, bundle: str, paths: list[PurePosixPath]) -> tuple[dict, dict]:
    """(volume, mount) of these files of one bundle of the Secret only, at `secrets_dir` as the
    bundle lays them out, group-readable by the pod's fsGroup."""
    items = [{"key": secret_key(bundle / p), "path": str(p)} for p in paths]
    volume = {"name": "secrets", "secret": {"secretName": SECRET, "defaultMode": 0o440, "items": items}}
    return volume, {"name": "secrets", "mountPath": cfg.secrets_dir, "readOnly": True}


def security(uid: int) -> tuple[dict, dict]:
    """(pod, container) security contexts: a fixed non-root user, as the compose files' images."""
    pod = {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid}
    pod["seccompProfile"] = {"type": "RuntimeDefault"}
    return pod, {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def probes(handler: dict) -> dict:
    """The compose healthchecks' test, every 2 s, as readiness; liveness the same, less eager."""
    return {
        "readinessProbe": {**handler, "periodSeconds": 2, "timeoutSeconds": 2, "failureThreshold": 3},
        "livenessProbe": {**handler, "periodSeconds": 10, "timeoutSeconds": 2, "failureThreshold": 3},
    }


def server_pod(cfg: ClusterConfig, uid: int, container: dict, bundle: str, files: list[PurePosixPath]) -> dict:
    volume, mount = secrets_volume(cfg, bundle, files)
    pod_security, container_security = security(uid)
    container |= {"volumeMounts": [mount], "securityContext": container_security}
    return {"securityContext": pod_security, "containers": [container], "volumes": [volume]}
