"""Loopback ports for the tests and the demo (devtools.local_s3.free_port): picked where
nothing else takes them between the pick and the bind, never the same twice in one run."""

import os
import socket

import pytest

from devtools import local_s3
from devtools.local_s3 import free_port

pytestmark = pytest.mark.unit


def test_ports_are_below_the_ephemeral_range_and_never_given_twice(monkeypatch):
    monkeypatch.delenv("PEAGLE_PORTS_GIVEN", raising=False)
    firsts = [free_port(span=16) for _ in range(40)]
    spans = [set(range(p, p + 16)) for p in firsts]
    assert all(local_s3._FIRST_PICKED_PORT <= p and p + 16 <= local_s3._ephemeral_low() for p in firsts)
    assert sum(len(s) for s in spans) == len(set().union(*spans))  # no two ranges overlap
    with socket.socket() as s:  # what it hands out can be bound
        s.bind(("127.0.0.1", firsts[0] + 15))


def test_a_port_given_out_in_a_parent_process_is_skipped(monkeypatch):
    # Everything in the range given out but one port: that one is the only answer.
    low, top = local_s3._FIRST_PICKED_PORT, local_s3._ephemeral_low() - 1
    left = next(p for p in range(low + 100, top) if local_s3._bindable(p))
    monkeypatch.setenv("PEAGLE_PORTS_GIVEN", f"{low}-{left - 1},{left + 1}-{top}")
    assert free_port() == left
    assert f"{left}-{left}" in os.environ["PEAGLE_PORTS_GIVEN"]
    with pytest.raises(RuntimeError, match="no 1 free consecutive ports"):
        free_port()
