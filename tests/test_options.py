"""flashbench/run/options.py: the run's defaults and how its options are checked."""

import pytest
from pydantic import ValidationError

from flashbench.run import options
from flashbench.run.options import MIN_WORKER_ADDRESS_SPACE, RunOptions, default_memory_limit


def test_a_cpu_workers_address_space_is_three_quarters_of_the_usable_memory(monkeypatch):
    monkeypatch.setattr(options, "usable_memory", lambda: 64 << 30)
    assert default_memory_limit() == 48 << 30
    monkeypatch.setattr(options, "usable_memory", lambda: None)
    assert default_memory_limit() is None


def test_a_small_container_still_leaves_a_worker_room_to_start(monkeypatch):
    monkeypatch.setattr(options, "usable_memory", lambda: 1 << 30)  # a 1 GiB cgroup: 0.75 GiB would not start torch
    assert default_memory_limit() == MIN_WORKER_ADDRESS_SPACE


def test_options_are_checked_by_field():
    with pytest.raises(ValidationError, match="iters"):
        RunOptions(iters=0)
    with pytest.raises(ValidationError, match="iterations"):
        RunOptions(iterations=3)
