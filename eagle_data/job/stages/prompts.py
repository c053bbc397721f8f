"""Rows -> chat messages -> validated, tokenized prompts (a `map_batches` stage).

Stage contract: takes `row_id`, `source`, `raw`, `origin` (FILE:LINE or "", put before a
skipped row's detail), `read_error` ("" or `REASON: why` the row could not be read); makes per
conversation (sampling.answers_per_prompt of them per usable row, job/variants.py)
`sample_id` (the conversation id), `prompt_id`, `answer`, `variant`, `messages` (the first
turn's prompt), `user_turns` (the user texts the target answers: one, or all of them under
`prompt.turns: all`), `tokenized_prompt` (rendered as its variant says), `num_prompt_tokens`,
`reason` ("" when the row is usable) and `detail`.
A row that cannot become a prompt is never an exception: it gets a reason (one row).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from typing import ClassVar

import pyarrow as pa

from eagle_data.config import Config, FieldsConfig
from eagle_data.job.stages.columns import Stage, columns
from eagle_data.errors import ConfigError
from eagle_data.job.variants import DEFAULT, Assigner, Variant, conversation_ids, frozen, variants
from eagle_data.model_files import control_token_pattern, generation_eos_ids, load_tokenizer, special_tokens
from eagle_data.storage.contract import PROMPTS_SCHEMA, SKIPPED_SCHEMA

ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
}

# What the stage makes: every column of prompts/ and of skipped/ (the phase splits rows by
# `reason`: "" goes to prompts/).
PROMPT_SCHEMA = pa.schema(
    [*PROMPTS_SCHEMA, *(f for f in SKIPPED_SCHEMA if f.name not in PROMPTS_SCHEMA.names)])


class Skip(Exception):
    """A row that cannot become a prompt: `reason` is a fixed code, `detail` says where."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class Turn:
    role: str | None  # normalised; None for a role no turn policy renders (`tool`, `function_call`, ...)
    content: str
    given_role: str  # as the row spells it
    where: str  # e.g. conversations[2]
    reasoning: object = None  # the turn's `reasoning_content` or `reasoning`, as the row has it (read for answers)

    def unknown_role(self, role_key: str) -> Skip:
        return Skip("bad_schema", f"{self.where}.{role_key} is an unknown role {self.given_role!r}")


def parse_turns(raw: str, fields: FieldsConfig | None = None) -> tuple[list[Turn], str]:
    """(the row's turns, the key that names a role), or Skip. Every turn must be well formed
    (an object with a string role and text): a row that is not is broken data. Which roles
    are allowed is the turn policy's to say, for the turns it uses. `fields`
    (source.fields): the turns are the row's fields it names."""
    try:
        row = json.loads(raw)
    except RecursionError:
        raise Skip("bad_json", "nested too deeply to parse") from None
    except ValueError as e:
        raise Skip("bad_json", f"line is not JSON ({e})") from None
    if not isinstance(row, dict):
        raise Skip("bad_schema", f"row is a {type(row).__name__}, not an object")
    if fields is not None:
        return field_turns(row, fields), "role"
    # A table (parquet, a folder of files) with both columns gives every row both keys, the
    # other one null: a row is read from whichever column holds it.
    if row.get("conversations") is not None:
        column, role_key, text_key = "conversations", "from", "value"
    elif row.get("messages") is not None:
        column, role_key, text_key = "messages", "role", "content"
    elif "conversations" in row:
        raise Skip("bad_schema", "'conversations' is null")
    else:
        raise Skip("bad_schema", "no 'conversations' (ShareGPT) or 'messages' (OpenAI) list")
    turns = row[column]
    if not isinstance(turns, list):
        raise Skip("bad_schema", f"'{column}' is a {type(turns).__name__}, not a list")
    out = []
    for i, turn in enumerate(turns):
        where = f"{column}[{i}]"
        if not isinstance(turn, dict):
            raise Skip("bad_schema", f"{where} is a {type(turn).__name__}, not an object")
        for key in (role_key, text_key):
            if key not in turn or turn[key] is None:
                raise Skip("bad_schema", f"{where} has no '{key}'")
            if not isinstance(turn[key], str):
                raise Skip("bad_schema", f"{where}.{key} is a {type(turn[key]).__name__}, not a string")
        for key in (role_key, text_key):
            try:
                turn[key].encode("utf-8")
            except UnicodeEncodeError as e:  # JSON allows "\ud800"; Unicode text does not
                raise Skip("bad_encoding", f"{where}.{key} holds a lone surrogate "
                                           f"U+{ord(turn[key][e.start]):04X} at {e.start}") from None
        reasoning = next((turn[k] for k in REASONING_KEYS if turn.get(k) is not None), None)
        out.append(Turn(ROLES.get(turn[role_key].strip().lower()), turn[text_key], turn[role_key], where, reasoning))
    return out, role_key


# Where a chat row's assistant turn keeps its reasoning, when not inline (<think>...</think>).
REASONING_KEYS = ("reasoning_content", "reasoning")


def field_turns(row: dict, fields: FieldsConfig) -> list[Turn]:
    """The turns of a row whose fields hold them (source.fields): the system message, then
    each user text followed by its answer (the assistant field's text answers the first
    user turn; a list, each in turn). A text is a string; a list field holds strings (an
    answer may be null: none)."""
    def texts(name: str, optional: bool) -> list:
        value = row.get(name)
        if value is None:
            if optional:
                return []
            raise Skip("bad_schema", f"no '{name}' (source.fields.user names it)")
        values = value if isinstance(value, list) else [value]
        for i, text in enumerate(values):
            where = f"{name}[{i}]" if isinstance(value, list) else name
            if not isinstance(text, str) and not (optional and text is None):
                raise Skip("bad_schema", f"{where} is a {type(text).__name__}, not a string")
            try:
                (text or "").encode("utf-8")
            except UnicodeEncodeError as e:
                raise Skip("bad_encoding", f"{where} holds a lone surrogate U+{ord(text[e.start]):04X} "
                                           f"at {e.start}") from None
        return values

    def named(name: str, i: int, many: bool) -> str:
        return f"{name}[{i}]" if many else name

    users = texts(fields.user, optional=False)
    answers = texts(fields.assistant, optional=True) if fields.assistant else []
    system = texts(fields.system, optional=True) if fields.system else []
    if len(system) > 1:
        raise Skip("bad_schema", f"'{fields.system}' holds {len(system)} texts, not one system message")
    many_users, many_answers = isinstance(row[fields.user], list), isinstance(row.get(fields.assistant), list)
    turns = [Turn("system", system[0], "system", fields.system)] if system and system[0] is not None else []
    for i, user in enumerate(users):
        turns.append(Turn("user", user, "user", named(fields.user, i, many_users)))
        if i < len(answers) and answers[i] is not None:
            turns.append(Turn("assistant", answers[i], "assistant", named(fields.assistant, i, many_answers)))
    return turns


def first_user_messages(turns: list[Turn], role_key: str) -> list[dict]:
    """Turn policy `first_user`: an optional leading system message + the first user message.
    It reads the turns up to the first user turn, where a role it does not know costs the
    row (that turn could have been the user's), and none after it."""
    user = None
    for turn in turns:
        if turn.role is None:
            raise turn.unknown_role(role_key)
        if turn.role == "user":
            user = turn
            break
    if user is None:
        raise Skip("no_user_turn", f"no user turn among {len(turns)} turns")
    if not user.content.strip():
        raise Skip("empty", "the first user turn is empty")
    messages = []
    if turns[0].role == "system" and turns[0].content.strip():
        messages.append({"role": "system", "content": turns[0].content})
    messages.append({"role": "user", "content": user.content})
    return messages


def conversation_messages(turns: list[Turn], role_key: str) -> tuple[list[dict], list[str]]:
    """Turn policy `all`: (the first turn's prompt messages, every user text in order). The
    dataset's assistant turns are dropped: the target writes its own. The conversation ends
    before its first turn of another role (`tool`, `function_call`, `observation`): such a
    turn answers a tool call of the dataset's assistant that the target never made, and the
    user turns after it may build on it; the user turns before it are answered."""
    messages = first_user_messages(turns, role_key)
    end = next((i for i, t in enumerate(turns) if t.role is None), len(turns))
    users = [t.content for t in turns[:end] if t.role == "user"]
    for i, text in enumerate(users):
        if not text.strip():
            raise Skip("empty", f"user turn {i} is empty")
    return messages, users


def answer_of(turns: list[Turn], markers: tuple[str, str], fields: FieldsConfig | None = None) -> tuple[str, str]:
    """prompt.answers=dataset: (reasoning, text) of the dataset's answer to the first user
    turn, the assistant turn right after it. Its reasoning is the turn's `reasoning_content`
    (or `reasoning`) field, or inline: a start ... end marker block at the start of its text
    (`markers` = model.reasoning_start, model.reasoning_end; leading whitespace aside). No
    such turn, or an empty one: Skip no_answer (naming source.fields.assistant's field, with
    `fields`). A marker anywhere else: Skip misplaced_reasoning (the text before it is never
    cut off, whatever the tokenizer makes of the markers)."""
    first = next(i for i, t in enumerate(turns) if t.role == "user")
    after = turns[first + 1] if first + 1 < len(turns) else None
    if after is None or after.role != "assistant":
        if fields is not None and fields.assistant:
            raise Skip("no_answer", f"no answer to {turns[first].where} in the row's '{fields.assistant}' "
                                    f"(source.fields.assistant)")
        said = f"{after.where} is {after.given_role!r}" if after is not None else "the row ends there"
        raise Skip("no_answer", f"no assistant turn right after the first user turn ({said})")
    reasoning, text = after.reasoning, after.content
    if reasoning is not None and not isinstance(reasoning, str):
        raise Skip("bad_schema", f"{after.where}'s reasoning is a {type(reasoning).__name__}, not a string")
    start, end = markers
    opens, closes = len(text) - len(text.lstrip()), -1
    if reasoning is None and start and end and text.startswith(start, opens):
        closes = text.find(end, opens + len(start))
    block = {(start, opens), (end, closes)} if closes >= 0 else set()  # the inline reasoning's markers
    stray = min(((i, m) for m in (start, end) if m for i in occurrences(text, m) if (m, i) not in block), default=None)
    if stray is not None:
        why = ("its reasoning is the turn's reasoning field, and its text holds no reasoning markers"
               if reasoning is not None else
               f"inline reasoning is read only from a {start!r}...{end!r} block at the start of its text")
        raise Skip("misplaced_reasoning", f"the answer ({after.where}) has {stray[1]!r} at character {stray[0]}: {why}")
    if block:
        reasoning, text = text[opens + len(start):closes].strip(), text[closes + len(end):].lstrip("\n")
    reasoning = reasoning or ""
    if not text.strip() and not reasoning.strip():
        raise Skip("no_answer", f"the answer ({after.where}) is empty")
    return reasoning, text


def occurrences(text: str, marker: str) -> list[int]:
    """Where `marker` starts in `text`, each place (overlapping ones too)."""
    found, at = [], text.find(marker)
    while at >= 0:
        found.append(at)
        at = text.find(marker, at + 1)
    return found


def sample_id_of(messages: list[dict]) -> str:
    """Content-derived and stable across runs and machines: a hash of the prompt messages."""
    text = json.dumps(messages, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


# What check_variants_render_apart renders per variant: a user turn, with and without a system turn.
PROBES = ([{"role": "user", "content": "What is 2+2?"}],
          [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "What is 2+2?"}])


@dataclass(frozen=True)
class PromptRenderer:
    """Renders conversations as the model sees them when it is to answer: the chat template
    (with each conversation's variant's arguments) and the generation prompt, tokenized.
    Shared by the prompts stage and the later-turn stage (turns.py); the tokenizer is
    loaded once per worker process (cached)."""

    tokenizer_path: str
    trust_remote_code: bool
    variants: dict[str, Variant]  # job/variants.py

    @staticmethod
    def fields(cfg: Config) -> dict:
        """The renderer's fields from the config (what every subclass shares)."""
        return {"tokenizer_path": cfg.model.tokenizer_path, "trust_remote_code": cfg.model.trust_remote_code,
                "variants": variants(cfg)}

    def render(self, conversations: list[list[dict]], names: list[str]) -> list[tuple[list[int] | None, str, str]]:
        """(ids, reason, detail) per conversation, rendered as its variant (`names`) says:
        reason "" when usable, `template_error` (ids None) or `prompt_too_long` (ids kept,
        for the count). Conversations whose variants render alike are tokenized together."""
        groups: dict[tuple, list[int]] = {}
        for i, name in enumerate(names):
            groups.setdefault(self.variants[name].renders_as, []).append(i)
        results: list = [None] * len(conversations)
        for indices in groups.values():
            variant = self.variants[names[indices[0]]]
            for i, result in zip(indices, self._render([conversations[i] for i in indices], variant)):
                results[i] = result
        return results

    def check_variants_render_apart(self) -> None:
        """Refuse (ConfigError) two variants whose chat-template arguments differ but render
        the probe conversations byte for byte alike: the template ignores the keys that
        differ (Kimi's `thinking` on Qwen3's template, `enable_thinking: "no"`, a typo), so
        one of the variants would silently be the other. Checked with the real tokenizer
        before the phase does any work."""
        tokenizer = load_tokenizer(self.tokenizer_path, self.trust_remote_code)
        seen: dict[tuple, Variant] = {}  # the probes' renderings -> the first variant rendering so
        def render(messages: list[dict], kwargs: dict) -> str | None:
            try:
                return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
            except Exception:  # a template may refuse a probe (a system turn): that probe tells nothing
                return None

        for variant in self.variants.values():
            texts = tuple(render(messages, variant.chat_template_kwargs) for messages in PROBES)
            if not any(texts):
                continue
            other = seen.setdefault(texts, variant)
            a, b = variant.chat_template_kwargs, other.chat_template_kwargs
            if frozen(a) != frozen(b):
                keys = sorted(k for k in {*a, *b} if k not in a or k not in b or frozen(a[k]) != frozen(b[k]))
                raise ConfigError(
                    f"sampling.variants: variant {variant.name!r} renders prompts byte for byte like variant "
                    f"{other.name!r}, though their chat_template_kwargs differ in {', '.join(map(repr, keys))}: "
                    f"the chat template of {self.tokenizer_path} ignores "
                    f"{'that key' if len(keys) == 1 else 'those keys'} or "
                    f"{'its value' if len(keys) == 1 else 'their values'} ({a!r} vs {b!r}). "
                    f"Use a key and a value the template reads (e.g. Qwen3 reads enable_thinking: false)")

    def _render(self, conversations: list[list[dict]], variant: Variant) -> list[tuple[list[int] | None, str, str]]:
        tokenizer = load_tokenizer(self.tokenizer_path, self.trust_remote_code)
        texts, results = [], []
        for messages in conversations:
            try:
                texts.append(tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True, **variant.chat_template_kwargs))
            except Exception as e:  # a chat template may raise on odd conversations
                texts.append(None)
                results.append((None, "template_error", f"{type(e).__name__}: {e}"))
                continue
            results.append(None)
        limit = variant.max_prompt_tokens
        why = "engine.max_model_len - sampling.max_tokens" if variant.name == DEFAULT else \
            f"engine.max_model_len - max_tokens of variant {variant.name!r}"
        # A row's cost is bounded by the limit, not by its size (docs/robustness.md): a text
        # above the bound is skipped on its length, never tokenized. Each token stands for at
        # most `longest` characters of the normalised text and a normaliser shrinks text at most
        # 4x (NFKC: a 4-byte character to one ASCII letter; NFC: 3 Hangul jamo to one syllable),
        # so a longer text has more than `limit` tokens.
        bound = limit * longest_token_chars(self.tokenizer_path, self.trust_remote_code) * 4
        for i, text in enumerate(texts):
            if text is not None and len(text) > bound:
                texts[i] = None
                results[i] = (None, "prompt_too_long", f"{len(text)} characters, more than {limit} prompt tokens "
                                                       f"({why}) whatever they are; not tokenized")
        ok = [i for i, t in enumerate(texts) if t is not None]
        # The template renders the special tokens itself: none added on top.
        encoded = tokenizer([texts[i] for i in ok], add_special_tokens=False)["input_ids"] if ok else []
        for i, ids in zip(ok, encoded):
            results[i] = (ids, "", "")
            if len(ids) > limit:
                results[i] = (ids, "prompt_too_long", f"{len(ids)} prompt tokens > {limit} ({why})")
        return results


    def render_answers(self, conversations: list[list[dict]], answers: list[tuple[str, str]],
                       prompts: list[list[int]], names: list[str],
                       stop_ids: tuple[int, ...]) -> list[tuple[list[int] | None, str, str]]:
        """prompt.answers=dataset: (the tokens the target would have generated to give each
        conversation's dataset answer, reason, detail). The conversation with its answer as
        the last assistant turn (reasoning as `reasoning_content`) is rendered with the chat
        template, as a regenerated row's tokens would be, and tokenized; its tokens must
        start with the prompt's own (`prompts`), and the answer's run up to and including
        its end-of-turn token, the first of `stop_ids` (the model's eos ids) after the prompt.
        Otherwise `answer_template_mismatch` (`template_error` when the template raises)."""
        tokenizer = load_tokenizer(self.tokenizer_path, self.trust_remote_code)
        texts, results = [], []
        for messages, (reasoning, text), name in zip(conversations, answers, names):
            assistant = {"role": "assistant", "content": text, **({"reasoning_content": reasoning} if reasoning else {})}
            try:
                texts.append(tokenizer.apply_chat_template(messages + [assistant], tokenize=False,
                                                           **self.variants[name].chat_template_kwargs))
                results.append(None)
            except Exception as e:  # a chat template may raise on odd conversations
                texts.append(None)
                results.append((None, "template_error", f"the answered conversation: {type(e).__name__}: {e}"))
        ok = [i for i, t in enumerate(texts) if t is not None]
        encoded = tokenizer([texts[i] for i in ok], add_special_tokens=False)["input_ids"] if ok else []
        for i, ids in zip(ok, encoded):
            prompt = prompts[i]
            if ids[:len(prompt)] != prompt:
                at = next((k for k, (a, b) in enumerate(zip(ids, prompt)) if a != b), min(len(ids), len(prompt)))
                results[i] = (None, "answer_template_mismatch",
                              f"the chat template renders the conversation with its answer as other tokens than "
                              f"the prompt's from token {at} of {len(prompt)} (prompt "
                              f"{tokenizer.decode(prompt[at:at + 6])!r}, rendered {tokenizer.decode(ids[at:at + 6])!r})")
                continue
            tail = ids[len(prompt):]
            end = next((k for k, t in enumerate(tail) if t in stop_ids), None)
            if end is None:
                results[i] = (None, "answer_template_mismatch",
                              f"the rendered answer has no end-of-turn token (the model's eos ids {list(stop_ids)})")
                continue
            results[i] = (tail[:end + 1], "", "")
        return results


@functools.lru_cache(maxsize=4)
def longest_token_chars(tokenizer_path: str, trust_remote_code: bool) -> int:
    """The most characters of text one token stands for: its longest vocabulary entry (added
    tokens included). A byte-level BPE entry spells each byte as one character, and a text
    has no more characters than bytes; a tokenizer that gives entries as bytes, their bytes."""
    tokenizer = load_tokenizer(tokenizer_path, trust_remote_code)
    return max(len(t) for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))) if t)


@dataclass(frozen=True)
class PromptBuilder(PromptRenderer, Stage):
    """The prompts stage."""

    reads: ClassVar = columns("row_id", "source", "raw", "origin", "read_error")
    makes: ClassVar = columns(*PROMPT_SCHEMA.names)

    reasoning_markers: tuple[str, ...] = ()
    turns: str = "first_user"  # prompt.turns
    max_turns: int | None = None  # prompt.max_turns
    answers: int = 1  # sampling.answers_per_prompt
    seed: int = 0  # sampling.seed: the variants' draw
    row_fields: FieldsConfig | None = None  # source.fields
    answer_stop_ids: tuple[int, ...] = ()  # prompt.answers=dataset: the model's eos ids; () = the target answers

    @classmethod
    def from_config(cls, cfg: Config) -> "PromptBuilder":
        stops = ()
        if cfg.prompt.answers == "dataset":  # the ids the generate phase stops at (generate.py target_tokens)
            tokenizer = load_tokenizer(cfg.model.tokenizer_path, cfg.model.trust_remote_code)
            stops = special_tokens(tokenizer, cfg.model.reasoning_start, cfg.model.reasoning_end,
                                   generation_eos_ids(cfg.model.path, cfg.model.trust_remote_code)).eos_ids
        return cls(**cls.fields(cfg), reasoning_markers=(cfg.model.reasoning_start, cfg.model.reasoning_end),
                   turns=cfg.prompt.turns, max_turns=cfg.prompt.max_turns,
                   answers=cfg.sampling.answers_per_prompt, seed=cfg.sampling.seed, row_fields=cfg.source.fields,
                   answer_stop_ids=stops)

    def apply(self, batch: pa.Table) -> pa.Table:
        """One row per dataset row that cannot become a prompt (answer 0, with its reason),
        `answers` rows (conversations) per one that can; a row is used whole or skipped whole."""
        control = control_token_pattern(
            self.tokenizer_path, self.trust_remote_code, self.reasoning_markers
        )
        assign = Assigner(self.variants, self.seed)
        rows = []
        for row_id, source, raw, origin, read_error in zip(*(batch.column(c).to_pylist() for c in self.reads)):
            base = {"row_id": row_id, "source": source, "raw": raw, "sample_id": "", "prompt_id": "",
                    "answer": 0, "variant": "", "messages": None, "user_turns": None, "reason": "",
                    "detail": "", "tokenized_prompt": None, "answer_ids": None, "dataset_answer": None}
            try:
                if read_error:  # bad_encoding or bad_file (job/stages/source.py)
                    raise Skip(*read_error.split(": ", 1))
                turns, role_key = parse_turns(raw, self.row_fields)
                if self.turns == "all":
                    messages, users = conversation_messages(turns, role_key)
                    # The conversation is identified by everything the target is asked.
                    identity = messages[:-1] + [{"role": "user", "content": u} for u in users]
                else:
                    messages = first_user_messages(turns, role_key)
                    users, identity = [messages[-1]["content"]], messages
                texts = [(m["role"], m["content"]) for m in messages] + [("user", u) for u in users]
                if self.answer_stop_ids:  # prompt.answers=dataset
                    base["dataset_answer"] = answer_of(turns, self.reasoning_markers, self.row_fields)
                    texts += [("assistant", text) for text in base["dataset_answer"]]
                for role, content in texts:
                    found = control.search(content)
                    if found:
                        raise Skip("special_token_in_content",
                                   f"{role} text contains control token {found.group()!r}")
            except Skip as s:
                rows.append([{**base, "reason": s.reason, "detail": s.detail, "origin": origin}])
                continue
            prompt_id = sample_id_of(identity)
            rows.append([{**base, "sample_id": conversation, "prompt_id": prompt_id, "answer": n,
                          "variant": assign(conversation), "messages": messages,
                          "user_turns": users[:self.max_turns], "origin": origin}
                         for n, conversation in enumerate(conversation_ids(prompt_id, self.answers))])

        flat = [c for group in rows for c in group if not c["reason"]]
        for c, (ids, reason, detail) in zip(flat, self.render([c["messages"] for c in flat],
                                                              [c["variant"] for c in flat])):
            c.update(tokenized_prompt=ids, reason=reason, detail=detail)
        if self.answer_stop_ids:
            flat = [c for c in flat if not c["reason"]]
            rendered = self.render_answers([c["messages"] for c in flat], [c["dataset_answer"] for c in flat],
                                           [c["tokenized_prompt"] for c in flat], [c["variant"] for c in flat],
                                           self.answer_stop_ids)
            for c, (ids, reason, detail) in zip(flat, rendered):
                c.update(answer_ids=ids, reason=reason, detail=detail)
        out = []
        for group in rows:
            bad = next((c for c in group if c["reason"]), None)
            if bad is not None:  # the dataset row, once, with the first reason
                ids = bad["tokenized_prompt"]
                out.append({**group[0], "sample_id": group[0]["prompt_id"], "reason": bad["reason"],
                            "num_prompt_tokens": len(ids) if ids else 0,
                            "detail": f"{bad['origin']}: {bad['detail']}" if bad["origin"] else bad["detail"],
                            "answer": 0, "tokenized_prompt": None, "user_turns": None, "answer_ids": None})
                continue
            out += [{**c, "num_prompt_tokens": len(c["tokenized_prompt"])} for c in group]
        return pa.Table.from_pylist(out, schema=PROMPT_SCHEMA)
