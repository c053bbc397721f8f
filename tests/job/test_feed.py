"""job/stages/feed.py on a real local Ray: every turn depth through one running pipeline,
driven by `drive`, the loop answer_turns (job/phases/generate.py) runs. Each test drains the pipeline in a thread with a deadline, since the failure this module
guards against is a pipeline that waits forever."""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest
import ray

from eagle_data.job.stages.feed import EngineFeed, drive


def depth(values: list[list[int]]) -> ray.data.Dataset:
    """A depth's blocks, of the sizes given (the last one smaller, as a depth's last batch is)."""
    return ray.data.from_arrow([pa.table({"x": v}) for v in values])


def drain(depths: list[tuple[ray.data.Dataset, int]], deadline_s: float = 90, single_depth: bool = False) -> dict:
    """answer_turns' loop (feed.drive) over `depths`, through a stage that takes each block
    whole; what came back, and how many batches had come when each next depth was asked for."""
    got = {"batches": [], "depth_ends": [], "error": None}

    def asked():  # drive asks for the next depth once the last one is back
        for i, d in enumerate(depths):
            if i:
                got["depth_ends"].append(len(got["batches"]))
            yield d
        got["depth_ends"].append(len(got["batches"]))

    def loop():
        try:
            drive(asked(), lambda source: source.map_batches(lambda b: b, batch_format="pyarrow"),
                  lambda batch: got["batches"].append(batch.column("x").to_pylist()), single_depth=single_depth)
        except Exception as e:  # noqa: BLE001
            got["error"] = e

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    thread.join(deadline_s)
    assert not thread.is_alive(), f"the pipeline waited forever; it had returned {got['batches']}"
    return got


def test_each_depth_comes_back_whole_before_the_next_is_sent(ray_local):
    # A depth's last block is smaller than the others and nothing comes after it until the
    # depth is back: the read, the stages and the driver's iterator must all hand it on.
    got = drain([(depth([[0, 1, 2], [3, 4, 5], [6]]), 7), (depth([[10, 11], [12]]), 3)])
    assert got["error"] is None
    assert sorted(x for b in got["batches"][:got["depth_ends"][0]] for x in b) == list(range(7))
    assert sorted(x for b in got["batches"][got["depth_ends"][0]:] for x in b) == [10, 11, 12]
    assert got["depth_ends"] == [3, 5]


def test_the_only_depth_ends_the_source_with_its_blocks(ray_local):
    # first_user: END follows the depth's blocks (the source ends as a read of files does).
    got = drain([(depth([[0, 1], [2]]), 3)], single_depth=True)
    assert got["error"] is None
    assert sorted(x for b in got["batches"] for x in b) == [0, 1, 2] and got["depth_ends"] == [2]


def test_no_depth_to_ask_runs_no_pipeline(ray_local):
    def never(source):
        raise AssertionError("a pipeline was built with nothing to ask")

    drive(iter([]), never, never)


def test_a_repartitioned_depth_sends_each_row_once_one_batch_per_block(ray_local):
    # The depth's own pass cuts its requests into engine batches with a strict repartition,
    # which hands on slices of blocks: every row must arrive once, in batches of 4.
    from eagle_data.job.ray_internals import one_batch_per_block

    rows = one_batch_per_block(depth([list(range(0, 7)), list(range(7, 10)), list(range(10, 19))]), 4)
    got = drain([(rows, 19)])
    assert got["error"] is None
    assert sorted(x for b in got["batches"] for x in b) == list(range(19))
    assert sorted(len(b) for b in got["batches"]) == [3, 4, 4, 4, 4]


def test_a_depth_that_cannot_be_built_fails_the_pipeline_with_its_own_error(ray_local):
    def broken(batch):
        raise ValueError("this depth's prompts cannot be rendered")

    got = drain([(depth([[0, 1]]), 2), (depth([[5]]).map_batches(broken, batch_format="pyarrow"), 1)])
    assert got["batches"] == [[0, 1]]  # the first depth was answered
    assert "cannot be rendered" in str(got["error"])


def test_a_depth_with_fewer_rows_than_counted_is_an_error_not_a_wait(ray_local):
    got = drain([(depth([[0, 1]]), 3)])
    assert isinstance(got["error"], RuntimeError)
    assert "sent 2 prompts where 3 were counted" in str(got["error"])


def test_the_queue_actor_is_gone_after_close(ray_local):
    feed = EngineFeed()
    actor = feed.queue.actor
    feed.close()
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.qsize.remote(), timeout=30)
