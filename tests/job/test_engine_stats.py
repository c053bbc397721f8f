"""job/stages/engines/stats.py on a real Ray instance's key-value store: the counters the
driver's progress line sums are those of replicas still publishing."""

from __future__ import annotations

import json
import time


def test_counters_a_dead_replica_left_behind_are_not_counted(ray_local):
    """A replica that died (killed, restarted, or one of an earlier phase of the same job)
    leaves its last counters in the store; summed forever, they would show requests running
    in an engine that is gone."""
    from ray.experimental import internal_kv

    from eagle_data.job.stages.engines.stats import ENGINE_STATS_NAMESPACE, PUBLISH_EVERY_S, engine_stats

    job = ray_local.get_runtime_context().get_job_id()
    now = time.time()
    entries = {"gone": {"generated_tokens": 500, "running": 4, "waiting": 2, "time": now - 30 * PUBLISH_EVERY_S},
               "alive": {"generated_tokens": 100, "running": 3, "waiting": 1, "time": now}}
    for actor, stats in entries.items():
        internal_kv._internal_kv_put(f"{job}/test-{actor}", json.dumps(stats), overwrite=True,
                                     namespace=ENGINE_STATS_NAMESPACE)
    try:
        assert [s for s in engine_stats() if s in entries.values()] == [entries["alive"]]
    finally:
        for actor in entries:
            internal_kv._internal_kv_del(f"{job}/test-{actor}", namespace=ENGINE_STATS_NAMESPACE)
