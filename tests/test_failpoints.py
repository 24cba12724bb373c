"""Failpoints (shared/failpoints.py): what a spec arms, scoping by process, and a file that
switches faults on and off while the process runs."""

from __future__ import annotations

import os
import random

import pytest

from shared.failpoints import Failpoints


def test_nth_hit_and_probability_and_scope():
    fp = Failpoints("a=drop@2;md/b=drop%100;rld-0/c=drop@1", rng=random.Random(0))
    fp.set_identity("md-0", "md")
    assert [fp.hit("a") for _ in range(4)] == [False, True, False, False]
    assert all(fp.hit("b") for _ in range(5)), "scoped to this role"
    assert not fp.hit("c"), "scoped to another instance"
    assert not fp.hit("unarmed")


def test_a_lossy_point_drops_about_its_share():
    fp = Failpoints("x=drop%5", rng=random.Random(1))
    assert 30 <= sum(fp.hit("x") for _ in range(1000)) <= 75


def test_a_file_arms_and_disarms_while_running(tmp_path):
    path = tmp_path / "failpoints"
    fp = Failpoints(path=str(path))
    assert not fp.hit("p")  # no file: nothing armed
    path.write_text("p=drop@1\n")
    assert fp.hit("p") and not fp.hit("p")
    path.write_text("p=off\n")
    os.utime(path, ns=(1, 1))  # a new stamp even within the clock's resolution
    assert not fp.hit("p")
    path.write_text("p=bogus")
    os.utime(path, ns=(2, 2))
    assert not fp.hit("p"), "a bad file is logged and arms nothing"


def test_a_bad_spec_is_refused_naming_the_entry():
    with pytest.raises(ValueError, match="'p=explode'"):
        Failpoints("p=explode")
