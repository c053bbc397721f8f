"""The engine stage without an engine (prompt.answers=dataset): each row's answer is the
dataset's own, which the prompts phase rendered with the target's chat template and
tokenized (prompts/'s `answer_ids`: the tokens the target would have generated to give it,
its end-of-turn token included, job/stages/prompts.py `render_answers`).

The stage hands those tokens back as the engine would have generated them, cut where the
engine cuts: after the first stop token of the row's request and at its `max_tokens` (an
answer longer than that is cut there and finishes as `length`, as a generated one would).
Its output columns are the engine stage's (outputs.py), so the postprocess stage that
follows (reasoning split, decode, loss mask, finish reason) is the one every row takes. No
model is loaded: it runs as Ray Data tasks, not an actor pool, and needs no GPU.
"""

from __future__ import annotations

import pyarrow as pa
import ray

from eagle_data.job.stages.columns import Stage, columns
from eagle_data.job.stages.engines.outputs import CONSUMED, ENGINE_ERROR_COLUMN, engine_output


class DatasetAnswers(Stage):
    """Requests with prompts/'s `answer_ids` -> the engine stage's output rows."""

    reads = columns("sample_id", *CONSUMED, "answer_ids")
    makes = columns("prompt_token_ids", "generated_tokens", ENGINE_ERROR_COLUMN)

    def apply(self, batch: pa.Table) -> pa.Table:
        made = []
        for prompt, params, answer in zip(*(batch.column(c).to_pylist() for c in (*CONSUMED, "answer_ids"))):
            stops = set(params["stop_token_ids"])
            end = next((i + 1 for i, t in enumerate(answer or ()) if t in stops), None)
            if end is None:  # prompts/ made under other stop ids than this run's (or none): never a guess
                made.append(engine_output(error=f"the dataset's answer (prompts/ answer_ids) has no stop token "
                                                f"of this run's model (eos ids {sorted(stops)})"))
                continue
            made.append(engine_output(prompt, answer[:min(end, params["max_tokens"])]))
        carried = batch.drop_columns([*CONSUMED, "answer_ids"])
        engine = pa.Table.from_pylist(made or [engine_output()]).slice(0, len(made))  # (its columns, also with no row)
        for name in engine.column_names:
            carried = carried.append_column(name, engine.column(name))
        return carried


def dataset_answers_stage(ds: ray.data.Dataset) -> ray.data.Dataset:
    # Each block is one engine batch (job/stages/feed.py): taken whole, never held back for more rows.
    return ds.map_batches(DatasetAnswers(), batch_size=None, batch_format="pyarrow")
