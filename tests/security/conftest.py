"""The attack suite runs against the end-to-end tests' session cluster (tests/cluster/conftest.py)."""

from tests.cluster.conftest import cluster, eos_ref, model_id, operator, reference  # noqa: F401
