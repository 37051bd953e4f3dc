"""Calibration's busy collective latency: what one collective issued between compute adds.

``busy_collective_seconds(compute, collective)`` is defined as the median time of N x (compute,
collective) minus N x compute alone, per call; ``link_latency`` turns it into a link's latency
per ring step. The 4-process measurement on real gloo groups is run by
``tests/test_search.py::test_calibrate_writes_a_loadable_hardware_file`` (slow) and compared
with measured plans by ``benchmarks/calibrated_pair.py``.
"""
from __future__ import annotations

import time

from autoshard.cost.calibrate import busy_collective_seconds, link_latency


def _work():
    return sum(range(2000))


def test_busy_seconds_measure_the_time_a_collective_adds_between_compute():
    # a "collective" that waits 3 ms (time.sleep waits at least that long): the measurement
    # must find at least that much per call, less the noise of timing the compute alone
    slept = busy_collective_seconds(_work, lambda: time.sleep(0.003), calls=8, repeats=3)
    assert slept >= 0.0025
    # a collective that costs nothing adds (within noise) nothing, and never a negative time
    free = busy_collective_seconds(_work, lambda: None, calls=8, repeats=3)
    assert 0.0 <= free < slept


def test_busy_seconds_start_every_repeat_at_the_barrier():
    calls = []
    busy_collective_seconds(_work, lambda: None, calls=2, repeats=3, barrier=lambda: calls.append(1))
    assert len(calls) == 2 * 3  # each of the two timings: 3 repeats, each after a barrier


def test_link_latency_spreads_the_busy_cost_over_the_ring_steps():
    # a ring all-reduce over R ranks has 2 (R - 1) latency steps
    assert abs(link_latency(1e-5, 3e-3, 2) - 3e-3 / 2) < 1e-12
    assert abs(link_latency(1e-5, 3e-3, 4) - 3e-3 / 6) < 1e-12
    # the isolated fit stays where it is larger, or where nothing busy was measured
    assert link_latency(1e-3, 3e-4, 2) == 1e-3
    assert link_latency(1e-3, None, 2) == 1e-3 and link_latency(1e-3, 0.0, 2) == 1e-3
