"""A job's own local Ray start (ray_internals.init_ray), which a loaded machine can make miss
Ray's fixed 30 s wait for its raylet."""

from __future__ import annotations

import pytest
from ray._private import services

from eagle_data.job import ray_internals


def starts(calls: list, fails: int, error: str):
    """A local Ray start that fails its first `fails` calls with `error`."""
    def start_local_ray():
        calls.append("start")
        if calls.count("start") <= fails:
            raise Exception(error)
    return start_local_ray


@pytest.fixture
def calls(monkeypatch) -> list:
    """What init_ray did, in order: its starts, and the shutdowns of what a failed one left."""
    done: list = []
    monkeypatch.setattr(services, "canonicalize_bootstrap_address", lambda address: None)  # no cluster to join
    monkeypatch.setattr(ray_internals.ray, "shutdown", lambda: done.append("shutdown"))
    return done


def test_a_start_that_misses_rays_wait_is_tried_again_after_shutting_down_what_it_left(calls, monkeypatch, caplog):
    monkeypatch.setattr(ray_internals, "start_local_ray", starts(calls, 2, "The current node timed out during startup."))
    ray_internals.init_ray()
    assert calls == ["start", "shutdown", "start", "shutdown", "start"]
    assert caplog.text.count("did not start in Ray's time") == 2


def test_the_third_miss_is_the_jobs_error(calls, monkeypatch):
    monkeypatch.setattr(ray_internals, "start_local_ray", starts(calls, 3, "The current node timed out during startup."))
    with pytest.raises(Exception, match="timed out during startup"):
        ray_internals.init_ray()
    assert calls == ["start", "shutdown", "start", "shutdown", "start"]


def test_any_other_failure_is_the_jobs_error_at_once(calls, monkeypatch):
    monkeypatch.setattr(ray_internals, "start_local_ray", starts(calls, 1, "address already in use"))
    with pytest.raises(Exception, match="address already in use"):
        ray_internals.init_ray()
    assert calls == ["start"]
