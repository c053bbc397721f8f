"""What is already done in OUT: read only the `sample_id` column of the published shards."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pyarrow.dataset as pads

from eagle_data.storage.shards import shard_files


def sample_ids(fs, folder: str) -> list[str]:
    files = shard_files(fs, folder)
    if not files:
        return []
    table = pads.dataset(files, filesystem=fs, format="parquet").to_table(columns=["sample_id"])
    return table.column("sample_id").to_pylist()


@dataclass
class SampleStatus:
    ok: set[str]
    failures: Counter  # sample_id -> failed attempts so far
    max_attempts: int
    stopped: set[str] = frozenset()  # turns not asked: the conversation stopped there

    @classmethod
    def read(cls, fs, out: str, max_attempts: int) -> "SampleStatus":
        return cls.of(sample_ids(fs, f"{out}/data"), sample_ids(fs, f"{out}/failed"),
                      sample_ids(fs, f"{out}/stopped"), max_attempts)

    @classmethod
    def of(cls, data: list[str], failed: list[str], stopped: list[str], max_attempts: int) -> "SampleStatus":
        """From the sample_ids of data/, failed/ (one per attempt) and stopped/ rows."""
        return cls(set(data), Counter(failed), max_attempts, set(stopped))

    @property
    def given_up(self) -> set[str]:
        """Samples with no ok row that used up their attempts: reported, not retried."""
        return {s for s, n in self.failures.items() if n >= self.max_attempts and s not in self.ok}

    def finished(self) -> set[str]:
        return self.ok | self.given_up | self.stopped

    @property
    def retryable(self) -> set[str]:
        """Samples with no ok row that failed and have attempts left."""
        return set(self.failures) - self.ok - self.given_up
