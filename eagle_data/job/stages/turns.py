"""Turn policy `all`: every user turn answered by the target, conditioned on its own answers.

The generate phase asks turn d once turn d-1 is published, all depths through one pipeline
(eagle_data/job/phases/generate.py, job/stages/feed.py). Turn d starts from the published
data/ rows of turn d-1: each row's prompt
messages, plus the target's answer to them, plus the conversation's next user text, make
turn d's conversation, which the chat template renders as a chat client would send it back
at inference: the answer as `content` and its reasoning as `reasoning_content` (the field
OpenAI-style servers hand reasoning out in); the template keeps or drops earlier reasoning
as it does at inference. The answer text is the decoded generated tokens, so a later
turn sees the earlier answer re-tokenized, exactly as a served model would.

Stage contract (TurnBuilder): takes data/ rows of turn d-1 (`conversation_id`, `source`,
`prompt_id`, `answer`, `variant`, `messages`, `reasoning`, `response`, `finish_reason`);
makes `sample_id`, `conversation_id`, `turn`, `source`, `prompt_id`, `answer`, `variant`
(a conversation keeps its variant: its template arguments and sampling), `messages`,
`tokenized_prompt` and `reason`/`detail`
for turns that cannot be asked: the conversation stops there, recorded in stopped/.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import ray

from eagle_data.config import Config
from eagle_data.job.stages.columns import Stage, columns
from eagle_data.job.stages.prompts import PromptRenderer
from eagle_data.storage.contract import DATA_SCHEMA, IDS, MESSAGE_TYPE, PROMPTS_SCHEMA, STOPPED_SCHEMA, turn_sample_ids
from eagle_data.storage.shards import shard_files

# What the stage makes: a turn's prompt, or why it cannot be asked (`reason` != "").
TURN_SCHEMA = pa.schema([*(DATA_SCHEMA.field(n) for n in (*IDS, "prompt_id", "answer", "variant", "messages")),
                         PROMPTS_SCHEMA.field("tokenized_prompt"), *(STOPPED_SCHEMA.field(n) for n in ("reason", "detail"))])
PREVIOUS_COLUMNS = ["conversation_id", "turn", "source", "prompt_id", "answer", "variant", "messages",
                    "reasoning", "response", "finish_reason"]


def next_user_texts(fs, prompts_folder: str, turn: int) -> pa.Table:
    """(conversation_id, user) for the conversations that have a user turn `turn`. Read
    batch by batch: the driver holds only these texts, not every conversation's turns."""
    parts = []
    files = shard_files(fs, prompts_folder)
    if files:
        dataset = pads.dataset(files, filesystem=fs, format="parquet")
        for batch in dataset.to_batches(columns=["sample_id", "user_turns"]):
            has = pc.greater(pc.list_value_length(batch.column("user_turns")), turn)
            batch = batch.filter(has)
            parts.append(pa.table({"conversation_id": batch.column("sample_id"),
                                   "user": pc.list_element(batch.column("user_turns"), turn)}))
    if not parts:
        return pa.table({"conversation_id": pa.array([], pa.string()), "user": pa.array([], pa.string())})
    return pa.concat_tables(parts)


def message(role: str, content: str, reasoning: str | None = None) -> dict:
    m = {"role": role, "content": content}
    if reasoning:
        m["reasoning_content"] = reasoning
    return m


@dataclass(frozen=True)
class TurnBuilder(PromptRenderer, Stage):
    """Builds turn `turn`'s prompts from turn `turn - 1`'s data/ rows (see module docstring)."""

    reads: ClassVar = columns(*PREVIOUS_COLUMNS)
    makes: ClassVar = columns(*TURN_SCHEMA.names)

    turn: int = 1
    next_users: ray.ObjectRef | None = None  # next_user_texts(..., turn), put once by the driver
    finished: ray.ObjectRef | None = None  # sample_ids not to redo

    @classmethod
    def from_config(cls, cfg: Config, turn: int, next_users: ray.ObjectRef, finished: ray.ObjectRef) -> "TurnBuilder":
        return cls(**cls.fields(cfg), turn=turn, next_users=next_users, finished=finished)

    def apply(self, batch: pa.Table) -> pa.Table:
        users = ray.get(self.next_users)
        where = pc.index_in(batch.column("conversation_id"), value_set=users.column("conversation_id"))
        has_next = pc.is_valid(where)
        batch, where = batch.filter(has_next), where.filter(has_next)
        sample_ids = turn_sample_ids(batch.column("conversation_id"), self.turn)
        todo = pc.invert(pc.is_in(sample_ids, value_set=ray.get(self.finished)))
        batch, where, sample_ids = batch.filter(todo), where.filter(todo), sample_ids.filter(todo)
        next_texts = users.column("user").take(where).to_pylist()

        n = batch.num_rows
        reasons, details = [""] * n, [""] * n
        conversations: list[list[dict] | None] = []
        previous = zip(*(batch.column(c).to_pylist()
                         for c in ("messages", "reasoning", "response", "finish_reason")))
        for i, (messages, reasoning, response, finish) in enumerate(previous):
            if finish != "stop":
                reasons[i] = "previous_answer_truncated"
                details[i] = f"the answer to turn {self.turn - 1} ended with finish_reason {finish!r}"
                conversations.append(None)
                continue
            conversations.append([
                *(message(m["role"], m["content"], m.get("reasoning_content")) for m in messages),
                message("assistant", response, reasoning),
                message("user", next_texts[i]),
            ])
        ok = [i for i, c in enumerate(conversations) if c is not None]
        prompts: list[list[int] | None] = [None] * n
        names = batch.column("variant").to_pylist()
        for i, (ids, reason, detail) in zip(ok, self.render([conversations[i] for i in ok], [names[i] for i in ok])):
            prompts[i] = None if reason else ids
            reasons[i], details[i] = reason, detail
        return pa.Table.from_arrays([
            sample_ids, batch.column("conversation_id"), pa.array([self.turn] * n, pa.int32()),
            batch.column("source"), batch.column("prompt_id"), batch.column("answer"), batch.column("variant"),
            pa.array(conversations, MESSAGE_TYPE),
            pa.array(prompts, pa.list_(pa.int32())), pa.array(reasons, pa.string()),
            pa.array(details, pa.string()),
        ], schema=TURN_SCHEMA)
