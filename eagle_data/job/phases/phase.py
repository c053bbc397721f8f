"""The shape every phase has: what `run.py`, the config checks and the summary need to know
of it, so that they loop over `eagle_data.job.phases.PHASES` instead of naming each one.

A phase reads what the phases before it wrote and writes its own folders
(`storage.contract.PHASES` names them, with its manifest record); its fingerprint is the
settings that decide its rows (job/fingerprints.py, from the config's tags).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from eagle_data.config import Config
from eagle_data.storage.folder import Output


@dataclass(frozen=True)
class Phase:
    name: str  # its --phase name and its record in manifest.json
    fingerprint: Callable[[Config], dict]
    run: Callable[..., dict]  # (cfg, out, engine=None) -> its counts over every run so far
    summary: Callable[[str, dict], list[str]]  # (OUT, counts) -> the job's closing lines
    reads: tuple[str, ...] = ()  # the phases whose rows it reads: their configs must still match
    in_all: Callable[[Config], bool] = lambda cfg: True  # whether `--phase all` runs it
    reads_dataset: bool = False
    needs_model_weights: bool = True
    empty: Callable[[Config, Output], str | None] = lambda cfg, out: None  # why its finished rows are none

    def locked_by(self) -> tuple[str, ...]:
        """The phases whose recorded config must equal this run's before it runs."""
        return (*self.reads, self.name)
