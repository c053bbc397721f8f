"""vLLM's own counters of each engine replica, published through Ray's GCS key-value store
for the driver's progress line (job/progress.py)."""

from __future__ import annotations

import json
import logging
import time

import ray

log = logging.getLogger("eagle_data")

ENGINE_STATS_NAMESPACE = "eagle_data_engine_stats"
PUBLISH_EVERY_S = 2
# Counters older than this are a replica's that stopped publishing (it died, was restarted,
# or belonged to an earlier phase of this job): its last values would otherwise count forever.
# (Compared with the driver's clock: nodes' clocks must agree within seconds, as NTP keeps them.)
STALE_AFTER_S = 10 * PUBLISH_EVERY_S


def publish_engine_stats(stats: dict) -> None:
    """From an engine replica: its latest counters, for the driver's progress line."""
    from ray.experimental import internal_kv

    context = ray.get_runtime_context()
    key = f"{context.get_job_id()}/{context.get_actor_id()}"
    internal_kv._internal_kv_put(key, json.dumps(stats), overwrite=True, namespace=ENGINE_STATS_NAMESPACE)


def engine_stats() -> list[dict]:
    """The latest counters of every engine replica of this job that is still publishing
    (publish_engine_stats)."""
    from ray.experimental import internal_kv

    prefix = f"{ray.get_runtime_context().get_job_id()}/"
    try:
        keys = internal_kv._internal_kv_list(prefix, namespace=ENGINE_STATS_NAMESPACE)
        values = [internal_kv._internal_kv_get(k, namespace=ENGINE_STATS_NAMESPACE) for k in keys]
    except Exception as e:  # best effort: a progress line without engine counters
        log.debug("engine stats unavailable: %s", e)
        return []
    now = time.time()
    return [s for s in map(json.loads, filter(None, values)) if now - s.get("time", 0) <= STALE_AFTER_S]


class EngineStats:
    """A vLLM stat logger that keeps the engine's own counters (generated tokens, requests
    running and waiting) and publishes them every few seconds for the driver's progress line."""

    def __init__(self):
        self.generated_tokens = self.running = self.waiting = 0

    @classmethod
    def attach(cls, engine) -> "EngineStats | None":
        import threading

        manager = getattr(engine, "logger_manager", None)  # None with disable_log_stats
        if manager is None:
            return None
        stats = cls()
        manager.stat_loggers.append(stats)
        threading.Thread(target=stats._publish, daemon=True, name="eagle-engine-stats").start()
        return stats

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        if iteration_stats is not None:
            self.generated_tokens += iteration_stats.num_generation_tokens
        if scheduler_stats is not None:
            self.running, self.waiting = scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs

    def log(self) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def record_sleep_state(self, *args) -> None:
        pass

    def _publish(self) -> None:
        while True:
            try:
                publish_engine_stats({"generated_tokens": self.generated_tokens, "running": self.running,
                                      "waiting": self.waiting, "time": time.time()})
            except Exception as e:  # best effort: the progress line goes without it
                log.debug("engine stats not published: %s", e)
            time.sleep(PUBLISH_EVERY_S)
