"""Cluster configurations that ship with the package: `single-host.yaml` (the default of
`pdd up`), `docker.yaml` (docker-compose.yml), `deploy-a.yaml` / `deploy-b.yaml` (deploy/),
and the simulator's fleets (sim/)."""

from pathlib import Path

CONFIGS = Path(__file__).resolve().parent
