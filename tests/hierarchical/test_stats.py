"""``WanStepMeter``: the per-step WAN figures the strategies log (pure logic, no process group)."""

from __future__ import annotations

import time

import pytest
import torch

from multidc.hierarchical.stats import WanStats, WanStepMeter


def test_wait_s_is_the_time_from_the_last_gradient_to_backward_done():
    weight = torch.nn.Parameter(torch.ones(3))
    meter = WanStepMeter(WanStats(), [weight])
    (weight * 2).sum().backward()
    time.sleep(0.05)  # what a rank spends waiting for buckets still on the WAN
    meter.backward_done()
    first = meter.take()
    assert 0.05 <= first["wan/wait_s"] < 1.0
    meter.backward_done()  # no gradient since: nothing to add
    assert meter.take()["wan/wait_s"] == 0.0


def test_bytes_seconds_and_throughput_are_deltas_since_the_previous_take():
    stats = WanStats()
    meter = WanStepMeter(stats, [])
    stats.add(sent=4_000_000, calls=1, seconds=2.0)
    assert meter.take() == {"wan/bytes_sent": 4e6, "wan/comm_s": 2.0, "wan/MBps": 2.0, "wan/wait_s": 0.0}
    stats.add(sent=1_000_000, calls=1, seconds=0.5)
    assert meter.take()["wan/MBps"] == pytest.approx(2.0)
    assert meter.take() == {"wan/bytes_sent": 0.0, "wan/comm_s": 0.0, "wan/MBps": 0.0, "wan/wait_s": 0.0}


def test_close_stops_timing_the_gradients():
    weight = torch.nn.Parameter(torch.ones(3))
    meter = WanStepMeter(WanStats(), [weight])
    meter.close()
    weight.sum().backward()
    time.sleep(0.02)
    meter.backward_done()
    assert meter.take()["wan/wait_s"] == 0.0
