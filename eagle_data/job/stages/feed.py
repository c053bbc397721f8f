"""The generate phase's source: one Ray Data pipeline, so one model load per engine
replica, for every turn depth.

`prompt.turns: all` asks turn d only once every turn d-1 answer is published (turn d's
prompt holds that answer; resume is per published turn). Building a pipeline per depth
started the engine replicas again per depth: for Kimi-K2.5 a 600 GB load each time. Here
the pipeline (requests -> engine -> postprocess) runs once; its source is a queue that the
driver fills with each depth's prompt blocks, built by a small Ray Data pass of their own
once the last depth's answers are all published. The engine replicas stay up in between.

The driver knows how many rows each depth sends (`to_ask`), and every row comes back as one
data/ or failed/ row, so it knows when a depth is done without waiting on the stream's end.
Nothing in the pipeline may hold a block back waiting for more, since more comes only once
the depth's answers are all back: the read hands each block on as it comes
(ray_internals.read_unshaped), the blocks are already one engine batch each (the depth's own
pass repartitions them) and the engine stage takes each as one batch (batch_size=None), and
the driver reads the results without prefetching (Ray Data's iterator holds a batch until
the next one arrives).

Kill -9 at any moment: nothing new is at risk. The queue holds only prompt blocks (rebuilt
from OUT by the rerun); what the driver published stays, as before. The queue and the read
task live on the driver's node, and the read task is never retried: a retry would skip the
blocks its first attempt had taken, and the driver would wait for their rows forever.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterator

import pyarrow as pa
import ray
from ray.data.block import BlockAccessor, BlockMetadata
from ray.data.datasource import Datasource, ReadTask
from ray.util.queue import Queue
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from eagle_data.job.ray_internals import read_unshaped

END = "end"  # the last item of the queue: no more depths
FAILED = "failed"  # the driver could not build a depth (its exception is in EngineFeed.error)
QUEUED_BLOCKS = 4  # prompt blocks waiting in the queue; the pipeline's own queues are bounded too


class QueueSource(Datasource):
    """One read task that yields the blocks put in `queue` until END."""

    def __init__(self, queue: Queue):
        self.queue = queue

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None) -> list[ReadTask]:
        queue = self.queue

        def read():
            while True:
                item = queue.get()
                if item == END:
                    return
                if item == FAILED:
                    raise RuntimeError("the driver could not build the next turn depth's prompts (see its log)")
                # One engine batch: its rows as (block, start, end) pieces (a Ray Data
                # bundle may hold slices of blocks, not whole blocks).
                yield pa.concat_tables([BlockAccessor.for_block(ray.get(ref)).slice(start, end)
                                        for ref, start, end in item])

        meta = BlockMetadata(num_rows=None, size_bytes=None, input_files=None, exec_stats=None)
        return [ReadTask(read, meta)]


class EngineFeed:
    """The queue between the driver and the running pipeline, and the depth in flight."""

    def __init__(self):
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.on_driver_node = here
        self.queue = Queue(maxsize=QUEUED_BLOCKS, actor_options={"num_cpus": 0, "scheduling_strategy": here})
        self.expected = self.received = 0
        self.sender: threading.Thread | None = None
        self.error: BaseException | None = None
        self.ended = False

    def dataset(self) -> ray.data.Dataset:
        read_unshaped(QueueSource)  # each block goes on as it comes (see there)
        # num_cpus 0: the read task waits on the queue for the whole run and must not hold
        # a CPU that the CPU stages need.
        return ray.data.read_datasource(QueueSource(self.queue), override_num_blocks=1, ray_remote_args={
            "num_cpus": 0, "max_retries": 0, "scheduling_strategy": self.on_driver_node})

    def send(self, depth: ray.data.Dataset, rows: int, last: bool = False) -> None:
        """Queue one depth's prompts (`rows` of them) from a thread: the driver keeps
        publishing answers meanwhile, or the pipeline, and then the queue, would stall.
        `last`: END follows its blocks, so the source ends with them, as a read of finished
        files does, and Ray Data can release a replica with nothing left to do (after a lost
        node, the restarted replica may need that replica's node)."""
        self.expected, self.received = rows, 0
        self.sender = threading.Thread(target=self._send, args=(depth, rows, last), daemon=True, name="eagle-feed")
        self.sender.start()

    def _send(self, depth: ray.data.Dataset, rows: int, last: bool) -> None:
        sent = 0
        try:
            for bundle in depth.iter_internal_ref_bundles():
                pieces = [(ref, cut.start_offset, cut.end_offset) if cut else (ref, 0, meta.num_rows)
                          for ref, meta, cut in zip(bundle.block_refs, bundle.metadata, bundle.slices)]
                if bundle.num_rows():
                    self.queue.put(pieces)
                    sent += bundle.num_rows()
            if sent != rows:  # the driver would wait for rows that never come
                raise RuntimeError(f"a turn depth sent {sent} prompts where {rows} were counted")
            if last:
                self.end()
        except BaseException as e:  # noqa: BLE001  (said by the driver, which re-raises it)
            self.error = e
            self.queue.put(FAILED)

    def results(self, ds: ray.data.Dataset) -> Iterator[pa.Table]:
        """The pipeline's output blocks as they come (see the module docstring)."""
        return ds.iter_batches(batch_format="pyarrow", batch_size=None, prefetch_batches=0)

    def depth_done(self, rows: int) -> bool:
        """Count `rows` answers of the depth in flight; True once all of them are back."""
        self.received += rows
        if self.received > self.expected:  # a request answered twice, or rows from nowhere
            raise RuntimeError(f"a turn depth got {self.received} answers to {self.expected} requests")
        return self.received == self.expected

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.queue.put(END)

    def close(self) -> None:
        ray.kill(self.queue.actor)


def drive(depths: Iterator[tuple[ray.data.Dataset, int]], pipeline: Callable[[ray.data.Dataset], ray.data.Dataset],
          on_batch: Callable[[pa.Table], None], single_depth: bool = False) -> None:
    """The driver's loop: every depth of `depths` ((blocks, how many rows)) through one
    running `pipeline(source)`, each depth sent once the last one's rows are all back, and
    each output batch given to `on_batch` (which publishes it) before the next depth is
    built: `depths` builds a depth from the answers published so far. `single_depth`: the
    first depth is the only one (END follows its blocks, see EngineFeed.send). When a depth
    cannot be sent, its own error is raised, not the pipeline's."""
    first = next(depths, None)
    if first is None:
        return
    feed = EngineFeed()
    try:
        feed.send(*first, last=single_depth)
        for batch in feed.results(pipeline(feed.dataset())):
            on_batch(batch)
            if feed.depth_done(batch.num_rows):
                following = next(depths, None)  # built from the answers just published
                if following is None:
                    feed.end()
                else:
                    feed.send(*following)
    except Exception:
        if feed.error is not None:  # the pipeline failed because a depth could not be sent
            raise feed.error from None
        raise
    finally:
        feed.close()
