"""The OUT contract: everything a reader of an OUT folder relies on, in one place.

The job's stages and the tools import it; it imports nothing of the job. The "Output"
section of docs/formats.md says the same (tests/test_layout.py checks that they agree).

    OUT/manifest.json   what made this OUT and what each phase and run produced (below)
    OUT/prompts/        one row per conversation to answer            PROMPTS_SCHEMA
    OUT/skipped/        dataset rows that cannot become a prompt      SKIPPED_SCHEMA
    OUT/data/           ok rows: the target's exact tokens + mask     DATA_SCHEMA (data_schema(k):
                        + top-k log-probabilities of each generated token, sampling.logprobs = k)
    OUT/failed/         engine errors, one row per failed attempt     FAILED_SCHEMA
    OUT/stopped/        turns not asked: the conversation stopped     STOPPED_SCHEMA
    OUT/hidden_states/  the target's hidden states of data/ rows      storage/hidden_states.py
    OUT/hidden_failed/  hidden-states attempts that failed            FAILED_SCHEMA
    OUT/report.json, report.html, report/*.png   the report (storage/report.py)
    OUT/vocab/          the draft vocabulary, when the vocab tool wrote it there (tools/vocab.py)

Shards are `part-<run id>-<n>.parquet` files in those folders (`.safetensors` in hidden_states/), published atomically with
Parquet page checksums (storage/shards.py). Every Parquet shard's footer (key-value metadata,
PROVENANCE) names the OUT (`out_id`), the run and the fingerprint of its phase's config
(PHASE_OF_FOLDER) it was made under: a job quarantines a shard of another OUT or config, and
rebuilds a lost or damaged manifest.json from them. Nothing else is ours: a job refuses an output.path
holding a file it did not write (`is_ours`), so --fresh and every delete touch only ours, and
--fresh deletes all of it (OWNED_FILES, OWNED_FOLDERS).

manifest.json (`schema_version` MANIFEST_VERSION):
    out_id:          this OUT's identity, drawn when the manifest is made; every shard carries it
    phases.prompts:  status (running | complete | stopped | damaged), counts (selected = prompts +
                     skipped dataset rows; conversations = prompts/ rows = prompts x
                     answers_per_prompt; per variant), prompt_config, runs
    phases.generate: counts, generate_config, answered_by (target | dataset), tokenizer (path,
                     vocab_size, eos_ids, pad_id, reasoning_start_id, reasoning_end_id), runs
    phases.hidden_states: counts, hidden_states_config, features (layer_ids, final_norm,
                     dtype, hidden_size, num_layers), runs (each with its storage estimate)
    a run: run_id, started_at, finished_at, status (running | complete | stopped: by a stop
           signal, with stopped_at and stopped_by; a killed run stays running), config (the
           whole resolved config of that run), versions (libraries), counts of that run;
           a generate run also: answered_by, replica_nodes (the Ray node ids its engine
           replicas ran on, when Ray's state API could tell)
Read it through storage/manifest.py's accessors, not by key chains.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

FOLDERS = ("prompts", "skipped", "data", "failed", "stopped", "hidden_failed")  # Parquet shards
HIDDEN_STATES = "hidden_states"  # safetensors shards (storage/hidden_states.py)
HIDDEN_FAILED = "hidden_failed"
MANIFEST = "manifest.json"
VOCAB_SUMMARY = "vocab/vocab.json"  # written by the vocab tool; read by the report
# Raised when this eagle-data cannot read an older OUT as its own (what each one added: docs/formats.md).
MANIFEST_VERSION = 4
ERROR = "error"  # failed/: the engine's error text
IDS = ("sample_id", "conversation_id", "turn", "source")  # carried by every data/failed/stopped row
ANSWERED_BY = ("target", "dataset")  # data/'s `answered_by`: the engine's answers, or the dataset's own

# `reasoning_content` is set only on the target's own earlier answers (turns: all), the
# field OpenAI-style clients and chat templates (Qwen3, Kimi) use for an answer's reasoning.
MESSAGE_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string()),
                                   ("reasoning_content", pa.string())]))

# The exact sampling values a row was answered with (its variant's, and its own seed).
SAMPLING_TYPE = pa.struct([("max_tokens", pa.int32()), ("temperature", pa.float64()), ("top_p", pa.float64()),
                           ("top_k", pa.int32()), ("min_p", pa.float64()), ("seed", pa.int64())])
# Which answer to which prompt a conversation is (job/variants.py): `prompt_id` is the hash of
# what the target is asked; with sampling.answers_per_prompt > 1 a prompt has several
# conversations, `<prompt_id>.<answer>`, each with its own seed and variant.
ANSWER_FIELDS = [("prompt_id", pa.string()), ("answer", pa.int32()), ("variant", pa.string())]

PROMPTS_SCHEMA = pa.schema([
    ("sample_id", pa.string()),  # the conversation id: prompt_id, or <prompt_id>.<answer>
    ("source", pa.string()),
    *ANSWER_FIELDS,
    ("messages", MESSAGE_TYPE),  # the first turn's prompt (optional system + first user turn)
    ("user_turns", pa.list_(pa.string())),  # the user texts the target answers, in order
    ("tokenized_prompt", pa.list_(pa.int32())),
    ("num_prompt_tokens", pa.int32()),
    ("row_id", pa.string()),  # hash of the dataset row
    # prompt.answers=dataset: the tokens the target would have generated to give the dataset's
    # answer (the chat template's, up to and including the end-of-turn token); else null.
    ("answer_ids", pa.list_(pa.int32())),
])
SKIPPED_SCHEMA = pa.schema([
    ("row_id", pa.string()), ("sample_id", pa.string()), ("source", pa.string()),
    ("reason", pa.string()), ("detail", pa.string()),
    ("raw", pa.string()),  # the dataset row as JSON text
])
DATA_SCHEMA = pa.schema([
    ("sample_id", pa.string()),
    # The conversation and which of its user turns this row answers (0 = the first);
    # under turns: first_user, conversation_id = sample_id and turn = 0.
    ("conversation_id", pa.string()),
    ("turn", pa.int32()),
    ("source", pa.string()),
    *ANSWER_FIELDS,
    ("sampling", SAMPLING_TYPE),  # null when answered by the dataset (nothing was sampled)
    ("answered_by", pa.string()),  # target | dataset (prompt.answers): who wrote the answer
    ("messages", MESSAGE_TYPE),
    ("reasoning", pa.string()),
    ("response", pa.string()),
    ("input_ids", pa.list_(pa.int32())),  # prompt tokens + generated tokens, exactly
    ("loss_mask", pa.list_(pa.int8())),  # aligned with input_ids; 1 = a training target
    ("num_prompt_tokens", pa.int32()),
    ("num_reasoning_tokens", pa.int32()),
    ("num_response_tokens", pa.int32()),
    ("finish_reason", pa.string()),  # stop | length
])
LOGPROB_COLUMNS = ("top_logprob_ids", "top_logprobs", "token_logprobs")  # data_schema(k > 0) adds them
LOGPROB_ARROW_TYPES = {"float32": pa.float32(), "float16": pa.float16()}  # data/'s top_logprobs per logprobs_dtype


def data_schema(logprobs: int = 0, dtype: str = "float32") -> pa.Schema:
    """data/'s schema: DATA_SCHEMA, plus with `logprobs` = k > 0 the target's top-k
    log-probabilities of every generated token (one entry per generated token, in order:
    num_reasoning_tokens + num_response_tokens of them; the k ids by rank, best first)."""
    if not logprobs:
        return DATA_SCHEMA
    return pa.schema([
        *DATA_SCHEMA,
        ("top_logprob_ids", pa.list_(pa.list_(pa.int32(), logprobs))),
        ("top_logprobs", pa.list_(pa.list_(LOGPROB_ARROW_TYPES[dtype], logprobs))),
        ("token_logprobs", pa.list_(pa.float32())),  # the sampled token's own log-probability
    ])


FAILED_SCHEMA = pa.schema([*(DATA_SCHEMA.field(n) for n in IDS), (ERROR, pa.string()), ("run_id", pa.string())])
STOPPED_SCHEMA = pa.schema([*(DATA_SCHEMA.field(n) for n in IDS), ("reason", pa.string()),
                            ("detail", pa.string()), ("run_id", pa.string())])
SCHEMAS = {"prompts": PROMPTS_SCHEMA, "skipped": SKIPPED_SCHEMA, "data": DATA_SCHEMA,
           "failed": FAILED_SCHEMA, "stopped": STOPPED_SCHEMA, HIDDEN_FAILED: FAILED_SCHEMA}

SHARD_NAME = re.compile(r"part-\d{8}T\d{6}-[0-9a-f]{6}-\d{5}\.parquet")
HIDDEN_SHARD_NAME = re.compile(r"part-\d{8}T\d{6}-[0-9a-f]{6}-\d{5}\.safetensors")
QUARANTINE = "quarantine"  # damaged shards moved out of the folders that are read
STAGING = ".staging"  # files being written; nothing reads them, the next run deletes them
LOCK = ".lock"
REPORT_FILES = ("report.json", "report.html")
REPORT_FIGURES = "report"  # report/*.png
VOCAB = "vocab"
# Everything the project writes at OUT's top level: is_ours accepts nothing else, --fresh deletes all of it.
OWNED_FILES = (MANIFEST, LOCK, *REPORT_FILES)
OWNED_FOLDERS = (*FOLDERS, HIDDEN_STATES, QUARANTINE, STAGING, VOCAB, REPORT_FIGURES)
# A damaged manifest.json is moved here (never deleted) when the job rebuilds it from the shards.
QUARANTINED_MANIFEST = re.compile(r"manifest-\d{8}T\d{6}-[0-9a-f]{6}\.json")

# A Parquet shard's key-value metadata: where its rows came from.
OUT_ID_KEY, RUN_KEY = "eagle_data.out_id", "eagle_data.run"
FINGERPRINT_KEY, CONFIG_KEY = "eagle_data.fingerprint", "eagle_data.config"  # the phase config's hash, and the config
PROVENANCE = (OUT_ID_KEY, RUN_KEY, FINGERPRINT_KEY, CONFIG_KEY)


@dataclass(frozen=True)
class PhaseRecord:
    """What OUT holds of one phase: its record in manifest.json (`phases.<name>`), the key
    there of the config that decides its rows, and the folders it writes (its done rows
    first)."""

    name: str
    config_key: str
    folders: tuple[str, ...]


# In the order they run; each reads what the ones before it wrote.
PHASES = (
    PhaseRecord("prompts", "prompt_config", ("prompts", "skipped")),
    PhaseRecord("generate", "generate_config", ("data", "failed", "stopped")),
    PhaseRecord("hidden_states", "hidden_states_config", (HIDDEN_STATES, HIDDEN_FAILED)),
)
PHASE_OF_FOLDER = {folder: phase.name for phase in PHASES for folder in phase.folders}
PHASE_CONFIG = {phase.name: phase.config_key for phase in PHASES}
# The prompts phase's count of each of its folders' rows: prompts/ holds one row per
# conversation (prompts x answers_per_prompt), so its rows are `conversations`, not `prompts`.
PROMPTS_ROW_COUNTS = {"prompts": "conversations", "skipped": "skipped"}


def is_ours(relative: str) -> bool:
    """Whether a file at this path inside OUT is one the project writes."""
    parts = relative.split("/")
    if len(parts) == 1:
        return parts[0] in OWNED_FILES
    top, name = parts[0], parts[-1]
    if top in (STAGING, VOCAB):
        return True
    if top == REPORT_FIGURES:
        return len(parts) == 2 and name.endswith(".png")
    if top == QUARANTINE:
        if len(parts) == 2:
            return bool(QUARANTINED_MANIFEST.fullmatch(name))
        return len(parts) == 3 and (parts[1] in FOLDERS and bool(SHARD_NAME.fullmatch(name))
                                    or parts[1] == HIDDEN_STATES and bool(HIDDEN_SHARD_NAME.fullmatch(name)))
    if top == HIDDEN_STATES:
        return len(parts) == 2 and bool(HIDDEN_SHARD_NAME.fullmatch(name))
    return top in FOLDERS and len(parts) == 2 and bool(SHARD_NAME.fullmatch(name))


# Under prompt.turns: all, a turn's sample_id is <conversation_id>-<turn>.
TURN_SEPARATOR = "-"


def turn_sample_id(conversation_id: str, turn: int) -> str:
    return f"{conversation_id}{TURN_SEPARATOR}{turn}"


def turn_sample_ids(conversation_ids: pa.Array | pa.ChunkedArray, turn: int) -> pa.Array:
    return pc.binary_join_element_wise(conversation_ids, pa.scalar(str(turn)), TURN_SEPARATOR)
