"""prompt.turns: all on a real local Ray with a real chat template (Qwen3): each
user turn is answered by the target, conditioned on its own earlier answers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict

import pyarrow.dataset as pads
import ray
import pytest
import yaml

from support import (REPO, as_config, attached, build_babbling_model, expected_conversation, job_settings, read,
                     shards, write_jsonl)
from eagle_data.model_files import load_tokenizer
from eagle_data.job.phases.run import run
from eagle_data.job.stages.engines import apply_engine
from eagle_data.tools.verify import verify

WORDS = [" the", " cat", " sat", " on", " mat", " and", " dog", " ran", "."]
LONG = " ".join(["please explain everything about the history of tea"] * 40)


@pytest.fixture(scope="session")
def babbling_qwen3(tmp_path_factory, qwen3_tokenizer_dir):
    probs = {**{w: 0.07 for w in WORDS}, "<think>": 0.05, "</think>": 0.1, "<|im_end|>": 0.22}
    return build_babbling_model(qwen3_tokenizer_dir, tmp_path_factory.mktemp("model") / "babble-qwen3",
                                ["<|im_end|>", "<|endoftext|>"], probs)


def conversations() -> list[dict]:
    """ShareGPT rows with 1-3 user turns; the dataset's own answers must never be used."""
    rows = []
    for i in range(8):
        n = 1 + i % 3
        turns = [{"from": "system", "value": "You are terse."}] if i % 4 == 0 else []
        for t in range(n):
            question = LONG if (i, t) == (5, 2) else f"question {t} of conversation {i}?"
            turns += [{"from": "human", "value": question},
                      {"from": "gpt", "value": f"DATASET ANSWER {i}.{t}"}]
        rows.append({"conversations": turns, "source": f"src{i % 2}"})
    return rows


# max_model_len - max_tokens = 232 prompt tokens: conversation 5's long third question does
# not fit, so that conversation stops at its second turn (or earlier, when an answer is cut
# off at max_tokens, which happens to ~0.3% of answers).
CHATS = dict(prompt__turns="all", engine__batch_size=4, engine__max_model_len=256, sampling__max_tokens=24,
             sampling__temperature=1.0, sampling__top_p=1.0, output__rows_per_shard=4)








def check_turns(out, rows: list[dict], tokenizer, answers_per_prompt: int = 1,
                template_kwargs: dict | None = None) -> dict:
    """Every data/ row's prompt is the template's rendering of the conversation so far with
    the target's own answers, with its variant's template arguments (`template_kwargs`:
    variant -> kwargs); its mask covers exactly the generated tokens; each conversation
    continues until its turns run out or a recorded stop, keeping its variant and prompt."""
    template_kwargs = template_kwargs or {"default": {}}
    prompts = {p["sample_id"]: p for p in read(out, "prompts")}
    by_conversation = defaultdict(dict)
    for d in read(out, "data"):
        assert d["sample_id"] == f"{d['conversation_id']}-{d['turn']}"
        assert d["turn"] not in by_conversation[d["conversation_id"]], "a turn answered twice"
        prompt = prompts[d["conversation_id"]]
        assert (d["prompt_id"], d["answer"], d["variant"]) == (prompt["prompt_id"], prompt["answer"], prompt["variant"])
        by_conversation[d["conversation_id"]][d["turn"]] = d
    stopped = {(s["conversation_id"], s["turn"]): s for s in read(out, "stopped")}
    assert read(out, "failed") == []
    # Map each conversation back to its dataset row through its first question.
    row_of = {}
    for row in rows:
        first = next(t["value"] for t in row["conversations"] if t["from"] == "human")
        matches = [c for c, p in prompts.items() if p["user_turns"][0] == first]
        assert len(matches) == answers_per_prompt and len({prompts[c]["prompt_id"] for c in matches}) == 1
        row_of.update(dict.fromkeys(matches, row))
    assert set(by_conversation) == set(prompts) == set(row_of)

    seen_later_turns = 0
    for conversation, turns in by_conversation.items():
        row = row_of[conversation]
        n_users = sum(t["from"] == "human" for t in row["conversations"])
        assert prompts[conversation]["user_turns"] == [t["value"] for t in row["conversations"]
                                                       if t["from"] == "human"]
        answers = [turns[t] for t in range(len(turns))]  # turns are 0..k with no gap
        for t, d in enumerate(answers):
            messages = expected_conversation(row, answers[:t])
            expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False, **template_kwargs[d["variant"]])
            n = d["num_prompt_tokens"]
            assert d["input_ids"][:n] == expected, (conversation, t)
            assert "DATASET ANSWER" not in tokenizer.decode(d["input_ids"])
            generated = len(d["input_ids"]) - n
            assert generated == d["num_reasoning_tokens"] + d["num_response_tokens"] > 0
            assert d["loss_mask"] == [0] * n + [1] * generated
            assert [m["role"] for m in d["messages"]] == [m["role"] for m in messages]
            seen_later_turns += t > 0
        last = len(answers) - 1
        if last + 1 < n_users:  # the conversation stopped early: recorded, with its reason
            stop = stopped[(conversation, last + 1)]
            reason = "prompt_too_long" if answers[last]["finish_reason"] == "stop" else "previous_answer_truncated"
            assert stop["reason"] == reason, stop
        else:
            assert not any(c == conversation for c, _ in stopped)
    assert seen_later_turns >= 4
    return {"conversations": len(by_conversation), "stopped": stopped}


# Qwen3's template has the thinking switch: two answers per prompt, each drawing one of two
# variants, thinking on or off. Each answer is its own conversation (`<prompt_id>.<n>`):
# its later turns are built on its own earlier answers, rendered with its variant's switch.
QWEN3_VARIANTS = dict(sampling__answers_per_prompt=2, sampling__variants=[
    {"name": "think"}, {"name": "no_think", "temperature": 0.7, "chat_template_kwargs": {"enable_thinking": False}}])
SWITCH = {"think": {}, "no_think": {"enable_thinking": False}}


@pytest.mark.slow
def test_each_turn_is_asked_with_the_targets_own_answers(ray_local, tmp_path, babbling_qwen3):
    """On Qwen3's template with its thinking switch (two variants). DeepSeek-R1's template,
    whose prompts open the reasoning: tests/vllm/test_vllm_engine.py's multi-turn run checks
    its prompts token for token the same way, on vLLM."""
    rows = conversations()
    settings = job_settings(tmp_path / "out", babbling_qwen3, write_jsonl(tmp_path / "chats.jsonl", rows),
                            preset=CHATS, **QWEN3_VARIANTS)
    pipelines = []

    def counted_engine(ds, cfg, pad_id):  # the real engine stage, counted: one per pipeline built
        pipelines.append(ds)
        return apply_engine(ds, cfg, pad_id)

    result = run(as_config(settings), engine=counted_engine)
    # Three turn depths through one pipeline: one actor pool, so the replicas loaded once.
    assert len(pipelines) == 1
    out = tmp_path / "out"
    tokenizer = load_tokenizer(str(babbling_qwen3))
    answers = settings["sampling"]["answers_per_prompt"]
    checked = check_turns(out, rows, tokenizer, answers, SWITCH)
    assert checked["conversations"] == result["prompts"]["conversations"] == 8 * answers
    assert result["prompts"]["prompts"] == 8
    assert set(result["prompts"]["conversations_by_variant"]) == set(SWITCH)
    assert result["prompts"]["user_turns"] == answers * sum(1 + i % 3 for i in range(8))
    # Conversation 5's third question is longer than the prompt budget.
    long_conversation = next(p["sample_id"] for p in read(out, "prompts") if LONG in p["user_turns"])
    assert any(c == long_conversation for c, _ in checked["stopped"])
    problems, counts = verify(str(out))
    assert problems == [] and counts["ok"] == result["generate"]["ok"]
    assert result["generate"]["stopped"] == len(checked["stopped"])
    report = json.loads((out / "report.json").read_text())["turns"]
    turns = [d["turn"] for d in read(out, "data")]
    assert report["ok_by_turn"] == {str(t): turns.count(t) for t in sorted(set(turns))}
    assert set(report["ok_by_turn"]) == {"0", "1", "2"}
    reasons = [s["reason"] for s in checked["stopped"].values()]
    assert report["stopped_by_reason"] == {r: reasons.count(r) for r in sorted(set(reasons))}

    # Rerunning finds every turn done or stopped: nothing is asked again, and no engine
    # pass is even built (for a large model, starting the replicas is a model load).
    def no_engine(ds, cfg, pad_id):
        raise AssertionError("an engine pass was built with nothing to ask")

    files = {f.name for f in shards(out, "data")}
    again = run(as_config(settings), engine=no_engine)["generate"]
    assert again == result["generate"] and {f.name for f in shards(out, "data")} == files

    # verify notices a later turn that should have been asked and has no row: a shard of
    # second-turn answers (shards hold one turn each) removed behind the job's back.
    lost = next(f for f in shards(out, "data") if {d["turn"] for d in pads.dataset(f).to_table().to_pylist()} == {1})
    lost_ids = {d["sample_id"] for d in pads.dataset(lost).to_table().to_pylist()}
    lost.unlink()
    problems, _ = verify(str(out))
    assert len(problems) == 1 and problems[0].startswith(f"{len(lost_ids)} turns that could be asked have no")
    assert problems[0].rsplit("e.g. ", 1)[1] in lost_ids


@pytest.mark.slow
def test_kill_between_turns_resumes_without_redoing_finished_turns(ray_local, tmp_path, babbling_qwen3):
    """SIGKILL the driver once the second turn's answers start to arrive; the rerun asks
    only the turns that had not been published."""
    rows = conversations() + [
        {"conversations": [{"from": "human", "value": f"extra {i}.{t}?"} for t in range(3)], "source": "more"}
        for i in range(4)]
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job_settings(
        tmp_path / "out", babbling_qwen3, write_jsonl(tmp_path / "chats.jsonl", rows),
        preset=CHATS, engine__batch_size=1, output__rows_per_shard=1)))
    out = tmp_path / "out"
    env = attached(ray_local)
    command = [sys.executable, "-m", "ray_jobs.generate", "--config", str(config)]

    job = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not any(d["turn"] >= 1 for d in read(out, "data")) and job.poll() is None:
        assert time.monotonic() < deadline, "no second-turn answer in time"
        time.sleep(0.05)
    assert job.poll() is None, "the job finished before it could be killed"
    os.kill(job.pid, signal.SIGKILL)
    job.wait()
    before = {f.name: [d["sample_id"] for d in pads.dataset(f).to_table().to_pylist()] for f in shards(out, "data")}
    done_before = {s for ids in before.values() for s in ids}
    assert {s for s in done_before if s.endswith("-0")} == {f"{p['sample_id']}-0" for p in read(out, "prompts")}
    assert not verify(str(out))[0]

    assert subprocess.run(command, cwd=REPO, env=env, capture_output=True).returncode == 0
    after = {f.name: [d["sample_id"] for d in pads.dataset(f).to_table().to_pylist()] for f in shards(out, "data")}
    # What the killed run published is untouched, and the rerun asked none of it again.
    assert {k: v for k, v in after.items() if k in before} == before
    redone = {s for name, ids in after.items() if name not in before for s in ids} & done_before
    assert redone == set()
    check_turns(out, rows, load_tokenizer(str(babbling_qwen3)))
    problems, counts = verify(str(out))
    assert problems == []
    manifest = json.loads((out / "manifest.json").read_text())
    runs = manifest["phases"]["generate"]["runs"]
    assert runs[-1]["status"] == "complete" and runs[-1]["ok"] == counts["ok"] - len(done_before)


def test_turn_builder_stops_a_conversation_with_a_reason(ray_local, qwen3_tokenizer_dir):
    """The stage alone, on hand-made turn-0 rows: a truncated answer and a prompt over budget
    stop their conversations; a finished turn is not asked again; a conversation without
    a next user turn drops out."""
    import pyarrow as pa

    from eagle_data.job.stages.turns import TurnBuilder
    from eagle_data.job.variants import Variant

    def previous(conversation, finish, response="ok"):
        return {"conversation_id": conversation, "turn": 0, "source": "s", "finish_reason": finish,
                "prompt_id": conversation, "answer": 0, "variant": "default",
                "messages": [{"role": "user", "content": "hi", "reasoning_content": None}],
                "reasoning": "thinking", "response": response}

    batch = pa.Table.from_pylist([previous("short", "stop"), previous("cut", "length"),
                                  previous("long", "stop"), previous("done", "stop"), previous("last", "stop")])
    users = pa.table({"conversation_id": ["short", "cut", "long", "done"],
                      "user": ["and then?", "and then?", LONG, "and then?"]})
    variant = Variant("default", 1.0, {}, {}, max_prompt_tokens=100)
    build = TurnBuilder(str(qwen3_tokenizer_dir), False, {"default": variant}, turn=1,
                        next_users=ray.put(users), finished=ray.put(pa.array(["done-1"])))
    rows = {r["conversation_id"]: r for r in build(batch).to_pylist()}
    assert set(rows) == {"short", "cut", "long"}
    assert rows["cut"]["reason"] == "previous_answer_truncated" and rows["cut"]["tokenized_prompt"] is None
    assert rows["long"]["reason"] == "prompt_too_long" and rows["long"]["tokenized_prompt"] is None
    short = rows["short"]
    assert short["reason"] == "" and short["sample_id"] == "short-1" and short["turn"] == 1
    assert [(m["role"], m["content"], m["reasoning_content"]) for m in short["messages"]] == [
        ("user", "hi", None), ("assistant", "ok", "thinking"), ("user", "and then?", None)]
    tokenizer = load_tokenizer(str(qwen3_tokenizer_dir))
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok", "reasoning_content": "thinking"},
         {"role": "user", "content": "and then?"}], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert short["tokenized_prompt"] == expected
    # Qwen3's template drops the reasoning of earlier answers, as it does when serving.
    assert "thinking" not in tokenizer.decode(expected)


def test_each_turn_of_a_conversation_gets_its_own_seed():
    """Turn ids share their conversation's prefix; the per-sample seed must still differ, or
    every turn of a conversation would draw the same random stream on vLLM."""
    from eagle_data.job.stages.requests import row_seed

    seeds = {row_seed(0, f"0123456789abcdef0123-{t}") for t in range(20)}
    assert len(seeds) == 20
    # Golden values: a sample's seed must be the same in every process and every release (a
    # rerun, another node, a resumed job reproduce its answer), so not Python's salted hash().
    # Computed once from the code and checked in fresh interpreters with other PYTHONHASHSEEDs.
    assert row_seed(0, "0123456789abcdef0123-0") == 2107877582
    assert row_seed(1, "0123456789abcdef0123-0") == 2108877585
    assert row_seed(7, "0123456789abcdef0123-3") == 1762282080
