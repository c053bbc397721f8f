"""Stage column contracts: each stage states the columns it requires and produces, and a
batch that lacks one fails with the stage's name (as Ray's own stages' `validate_inputs`)."""

from __future__ import annotations

from typing import Iterable

import pyarrow as pa

from eagle_data.errors import EagleDataError


class MissingColumns(EagleDataError):
    """A stage got a batch without a column it requires: a wiring bug, named."""


def require(stage: str, batch: pa.Table, columns: Iterable[str]) -> None:
    missing = [c for c in columns if c not in batch.column_names]
    if missing:
        raise MissingColumns(f"{stage} requires columns {missing}; the batch has {batch.column_names}")
