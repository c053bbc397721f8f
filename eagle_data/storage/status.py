"""What a phase already did in OUT: the samples in its published shards (only their ids are
read) and its failed attempts."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pyarrow.dataset as pads

from eagle_data.storage.contract import HIDDEN_STATES, PHASES
from eagle_data.storage.hidden_states import Index, input_ids_digests, stale
from eagle_data.storage.shards import readable_shards, shard_files


def sample_ids(fs, folder: str) -> list[str]:
    files = shard_files(fs, folder)
    if not files:
        return []
    table = pads.dataset(files, filesystem=fs, format="parquet").to_table(columns=["sample_id"])
    return table.column("sample_id").to_pylist()


def done_ids(fs, folder: str) -> list[str]:
    """The samples a folder of published shards holds (hidden_states/: current_entries)."""
    out, name = folder.rsplit("/", 1)
    if name == HIDDEN_STATES:
        return list(current_entries(fs, out))
    return sample_ids(fs, folder)


def current_entries(fs, out: str) -> dict:
    """hidden_states/ entries computed from their data/ row's input_ids: one whose row was
    answered again with other tokens is stale, not done (nor counted), and so is one whose
    row is in a damaged data/ shard (named and left out: a job quarantines it at start)."""
    digests = input_ids_digests(fs, readable_shards(fs, f"{out}/data", skip=True))
    return {s: e for s, e in Index.read(fs, f"{out}/{HIDDEN_STATES}").entries.items() if not stale(e, digests.get(s))}


@dataclass
class SampleStatus:
    ok: set[str]
    failures: Counter  # sample_id -> failed attempts so far
    max_attempts: int
    stopped: set[str] = frozenset()  # turns not asked: the conversation stopped there

    @classmethod
    def read(cls, fs, out: str, max_attempts: int, phase: str = "generate") -> "SampleStatus":
        """Of a phase that answers samples (its folders: done, failed[, stopped])."""
        done, failed, *stopped = next(p.folders for p in PHASES if p.name == phase)
        return cls.of(done_ids(fs, f"{out}/{done}"), sample_ids(fs, f"{out}/{failed}"),
                      sample_ids(fs, f"{out}/{stopped[0]}") if stopped else [], max_attempts)

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
