"""shared/heap.py: what startup made is frozen out of the collector's reach, and every later
collection is timed. Run in a child process: a frozen generation and a gc callback are for a
process's whole life, not for the test runner's."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent(
    """
    import gc, json
    from prometheus_client.parser import text_string_to_metric_families
    from shared import heap
    from shared.telemetry import Metrics

    startup = [{"n": [i]} for i in range(50_000)]  # a model's worth of long-lived containers
    metrics = Metrics("m", "x")
    frozen = heap.settle(metrics)
    left = len(gc.get_objects())  # what the collector still walks
    gc.collect()  # a full collection, timed
    samples = {
        (s.name, s.labels.get("generation")): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }
    print(json.dumps({
        "frozen": frozen,
        "left": left,
        "gauge": samples[("pdd:gc_frozen_objects", None)],
        "gen2": samples[("pdd:gc_pause_seconds_count", "2")],
    }))
    """
)


def test_startup_objects_are_frozen_and_later_collections_timed():
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["frozen"] >= 100_000  # the 50,000 dicts and their lists, and the imports'
    assert got["left"] < 1_000  # the collector no longer walks them
    assert got["gauge"] == got["frozen"]
    assert got["gen2"] == 1  # the full collection after settle(), and only it
