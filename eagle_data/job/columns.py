"""Stage column contracts: each stage states the columns it requires and produces, and a
batch that lacks one fails with the stage's name (as Ray's own stages' `validate_inputs`)."""

from __future__ import annotations

from typing import Iterable

import pyarrow as pa


class MissingColumns(LookupError):
    """A stage got a batch without a column it requires: a wiring bug, named. Internal, not an
    EagleDataError on purpose: the entry points let it through with its traceback."""


def require(stage: str, batch: pa.Table, columns: Iterable[str]) -> None:
    missing = [c for c in columns if c not in batch.column_names]
    if missing:
        raise MissingColumns(f"{stage} requires columns {missing}; the batch has {batch.column_names}")
