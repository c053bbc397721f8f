"""The pilot (`python -m ray_jobs.pilot`): its settings refused in one line before anything
starts, its record of the stages (pilot.json) and the folder it owns; and the whole pilot
as a user runs it, killed in each kind of stage and run again, is
tests/test_benchmarks.py's smoke of benchmarks/recipe_study.py (SmolLM2, vLLM's CPU build)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from support import as_config, job_settings, write_jsonl
from eagle_data.errors import ConfigError, ForeignFiles
from eagle_data.evaluation import pilot
from eagle_data.evaluation.pilot import State, check_folder, refuse_changes
from eagle_data.evaluation.pilot_stages import stages

# As tests/evaluation/test_acceptance_job.py's: vLLM's CPU build with the smallest footprint.
VLLM = dict(engine__backend="vllm", engine__device="cpu", engine__num_cpus=1, engine__cpu_kv_cache_gib=0.25,
            engine__batch_size=4, engine__max_concurrent_batches=4, engine__resource_wait_s=60, engine__cpu_threads=1,
            engine__engine_kwargs={"dtype": "float32", "enforce_eager": True, "max_num_seqs": 8})
# The recipes' own jobs on the transformers engine: cheaper than a vLLM start each.
TRANSFORMERS = {"engine.backend": "transformers", "engine.engine_kwargs": {"dtype": "float32"}}
QUESTIONS = [{"question": f"Problem {i}: what is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}. The answer is {2 * i}."}
             for i in range(1, 21)]
HELD_OUT = [{"question": f"What is {i} times 3?", "kind": "times" if i % 2 else "odd"} for i in range(1, 7)]


def settings(tmp_path, model, **pilot_settings) -> dict:
    """A pilot of two recipes (the dataset's answers, greedy) on 12 of 20 questions, drafts
    trained 4 steps from OUT's hidden states, the greedy one measured at step 2 too."""
    train = write_jsonl(tmp_path / "train.jsonl", QUESTIONS)
    held = write_jsonl(tmp_path / "held.jsonl", HELD_OUT)
    config = job_settings(tmp_path / "unused", model, train, source__sample=12, sampling__max_tokens=12,
                          source__fields={"user": "question", "assistant": "answer"}, hidden_states__dtype="float32",
                          **VLLM)
    config["train"] = {"workers": 1, "device": "cpu", "cpus_per_worker": 0, "batch_size": 2,
                       "source": "hidden_states", "speculators": {
                           "trainer": {"epochs": 100, "max_steps": 4}, "loss": {"loss_implementation": "eager"},
                           "draft": {"draft_vocab_size": 256, "draft_attn_impl": "eager"},
                           "optimizer": {"lr": 0.01}, "data": {"train_data_ratio": 1.0}}}
    config["acceptance"] = {"bootstrap": 200}
    config["pilot"] = {"path": str(tmp_path / "pilot"),
                       "recipes": {"dataset": {"prompt.answers": "dataset", **TRANSFORMERS}, "greedy": TRANSFORMERS},
                       "held_out": {"dataset": str(held), "fields": {"user": "question", "source": "kind"}},
                       "measure_steps": [2], "measure_steps_of": ["greedy"], **pilot_settings}
    return config


@pytest.mark.parametrize("change, message", [
    ({"pilot": {"path": None}}, r"pilot.path is not set"),
    ({"pilot": {"recipes": {}}}, r"pilot.recipes is empty"),
    ({"pilot": {"held_out": None}}, r"pilot.held_out is not set"),
    ({"engine": {"backend": "transformers"}}, r"engine.backend transformers: the pilot measures the drafts with vLLM"),
    ({"pilot": {"recipes": {"a b": {}}}}, r"pilot.recipes: 'a b' is not a recipe name"),
    ({"pilot": {"recipes": {"x": {"model.path": "/other"}}}}, r"pilot.recipes.x: 'model.path' cannot be changed by a "
                                                              r"recipe \(a recipe changes what makes its rows"),
    ({"pilot": {"recipes": {"x": {"output.path": "/o"}}}}, r"pilot.recipes.x: 'output.path' cannot be changed by a "
                                                           r"recipe \(the pilot sets it\)"),
    ({"pilot": {"recipes": {"x": {"sampling.temprature": 0.7}}}},
     r"pilot.recipes.x: the config it makes is not valid: sampling.temprature: Extra inputs are not permitted"),
    ({"pilot": {"recipes": {"x": {"sampling.temperature": -1}}}},
     r"pilot.recipes.x: the config it makes is not valid: sampling.temperature: Input should be greater than or equal"),
    ({"pilot": {"recipes": {"x": {"sampling": 1}}}}, r"pilot.recipes.x: 'sampling' cannot be changed by a recipe"),
    ({"pilot": {"recipes": {"x": {"sampling.temperature.x": 1}}}},
     r"pilot.recipes.x: sampling.temperature is not a section \(setting sampling.temperature.x\)"),
    ({"pilot": {"measure_steps_of": ["nope"]}}, r"pilot.measure_steps_of names nope, not among pilot.recipes"),
    ({"pilot": {"compare_to": ["nope"]}}, r"pilot.compare_to names nope, not among pilot.recipes"),
    ({"train": {"checkpoint_every": 3}}, r"pilot.measure_steps \[2\]: not multiples of train.checkpoint_every 3"),
    ({"pilot": {"held_out": {"dataset": "x.jsonl", "sample": 0}}},
     r"pilot.held_out.sample: Input should be greater than or equal to 1"),
])
def test_bad_pilot_settings_are_refused_in_one_line_naming_the_key(tmp_path, tiny_qwen3, change, message):
    config = settings(tmp_path, tiny_qwen3)
    for section, values in change.items():
        if section == "pilot" and values.get("recipes"):  # a recipe added beside the two
            config["pilot"]["recipes"].update(values["recipes"])
        else:
            config.setdefault(section, {}).update(values)
    with pytest.raises(ConfigError, match=message) as raised:
        stages(as_config(config))  # the config's own checks, or the pilot's
    assert "\n" not in str(raised.value)


def test_a_config_without_a_train_section_is_refused(tmp_path, tiny_qwen3):
    config = settings(tmp_path, tiny_qwen3)
    del config["train"]
    with pytest.raises(ConfigError, match=r"the config has no `train:` section: the pilot trains every recipe's draft"):
        stages(as_config(config))


def test_the_stages_each_recipes_config_and_the_drafts_measured(tmp_path, tiny_qwen3):
    """Two stages a recipe, then the acceptance job over every final draft and the measured
    checkpoints; what the pilot sets in each job's config."""
    planned = stages(as_config(settings(tmp_path, tiny_qwen3)))
    root = tmp_path / "pilot"
    assert [s.name for s in planned] == ["generate:dataset", "train:dataset", "generate:greedy", "train:greedy",
                                         "acceptance"]
    dataset, greedy = planned[0].config, planned[2].config
    assert dataset["prompt"]["answers"] == "dataset" and "prompt" not in greedy  # as the config says it: unset
    assert dataset["output"]["path"] == str(root / "recipes/dataset/out")
    assert dataset["hidden_states"]["enabled"] is True  # train.source: hidden_states
    assert greedy["train"]["speculators"]["trainer"]["save_path"] == str(root / "recipes/greedy/draft")
    assert greedy["train"]["checkpoint_every"] == 2 and "checkpoint_every" not in dataset["train"]
    assert dataset["source"] == greedy["source"]  # the same training prompts
    acceptance = planned[-1].config
    assert acceptance["acceptance"]["drafts"] == {"dataset": str(root / "recipes/dataset/draft/final"),
                                                  "greedy": str(root / "recipes/greedy/draft/final"),
                                                  "greedy@2": str(root / "recipes/greedy/draft/step-2")}
    assert acceptance["source"]["dataset"].endswith("held.jsonl") and acceptance["output"]["path"] == str(
        root / "held-out")
    assert acceptance["engine"]["backend"] == "vllm"  # the base config's: the recipes changed only their own


def test_a_finished_stage_whose_settings_changed_is_refused_naming_the_keys(tmp_path, tiny_qwen3):
    """pilot.json says generate:greedy finished with temperature 0; the config now says 0.5:
    refused, naming the key and both values. An unfinished stage runs again (its job decides);
    the acceptance stage may measure more drafts; a setting that only says how fast is free."""
    planned = stages(as_config(settings(tmp_path, tiny_qwen3)))
    root = tmp_path / "pilot"
    check_folder(root)
    state = State(root)
    for stage in planned:
        state.stage(stage.name).update(config=stage.config, done=True, seconds=1.0)
    state.save()
    changed = settings(tmp_path, tiny_qwen3)
    changed["pilot"]["recipes"]["greedy"] = {**TRANSFORMERS, "sampling.temperature": 0.5}
    changed["output"]["log_every_s"] = 1  # operational
    with pytest.raises(ConfigError, match=r"pilot: stage generate:greedy ran with other settings than the config gives "
                                          r"now \(sampling.temperature: 0.0 -> 0.5\)"):
        refuse_changes(stages(as_config(changed)), State(root))
    state.stage("generate:greedy")["done"] = False
    state.stage("train:greedy")["done"] = False
    state.save()
    refuse_changes(stages(as_config(changed)), State(root))
    more = settings(tmp_path, tiny_qwen3)
    more["pilot"]["recipes"]["t07"] = {**TRANSFORMERS, "sampling.temperature": 0.7}
    refuse_changes(stages(as_config(more)), State(root))  # a recipe added: its stages are new, acceptance measures more


def test_the_pilot_folder_is_its_own(tmp_path):
    """New, empty or the pilot's (pilot.json and its folders): anything else is refused
    before a file is written; a pilot.json that is not the pilot's too."""
    check_folder(tmp_path / "new")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("mine")
    with pytest.raises(ForeignFiles, match=r"pilot.path .*used holds files the pilot did not write \(notes.txt\)"):
        check_folder(tmp_path / "used")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "recipes").mkdir()
    with pytest.raises(ForeignFiles, match=r"holds files the pilot did not write \(recipes\)"):
        check_folder(tmp_path / "other")
    (tmp_path / "other" / "pilot.json").write_text("[1, 2]")
    with pytest.raises(ForeignFiles, match=r"pilot.json is not the pilot's record"):
        State(tmp_path / "other")
    assert (tmp_path / "used" / "notes.txt").read_text() == "mine"


def test_a_stage_process_a_killed_pilot_left_is_waited_for_then_killed(tmp_path, monkeypatch):
    """pilot.json names the stage's process that was running when the pilot died: the next
    pilot waits for it (it holds its OUT's lock while it stops), and SIGKILLs it when it
    outlives the wait; a pid now another process's (its start time differs) is left alone."""
    monkeypatch.setattr(pilot, "LEFTOVER_WAIT_S", 1)
    stuck = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                              "signal.SIG_IGN); time.sleep(60)"])
    try:
        check_folder(tmp_path / "p")
        state = State(tmp_path / "p")
        state.data["running"] = {"stage": "generate:x", "pid": stuck.pid, "start": pilot.start_time(stuck.pid)}
        pilot.wait_for_leftover(state)
        assert stuck.wait(10) == -signal.SIGKILL
        assert "running" not in json.loads((tmp_path / "p" / "pilot.json").read_text())
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        state.data["running"] = {"stage": "generate:x", "pid": other.pid, "start": "1"}  # another process's pid now
        pilot.wait_for_leftover(state)
        assert other.poll() is None
        other.kill()
        other.wait()
    finally:
        stuck.kill()


def test_the_reports_pairs_verdicts_and_a_figure_with_nothing_to_count():
    """Each two recipes compared once; an interval that holds 0 is no difference; a tau with
    nothing to count (no step proposed a draft token) prints as '-', never nan."""
    from eagle_data.evaluation.pilot_report import pairs, table, verdict

    assert pairs(["dataset", "greedy", "t07"], ["dataset", "greedy"]) == [
        ("greedy", "dataset"), ("t07", "dataset"), ("t07", "greedy")]
    assert [verdict(i) for i in ([-0.1, 0.2], [0.05, 0.2], [-0.3, -0.1], None)] == [
        "no difference", "higher", "lower", "nothing to compare"]
    nothing = {"tau": None, "tau_95": None, "note": "no step proposed a draft token", "by_source": {}}
    figures = {"recipes": ["dataset", "greedy"], "baseline": "dataset", "num_speculative_tokens": 3, "prompts": 2,
               "tau": {"0": {"drafts": {"dataset": nothing, "greedy": {"tau": 1.5, "tau_95": [1.2, 1.8],
                                                                           "by_source": {}}},
                             "differences": {"greedy - dataset": {"difference": None, "difference_95": None}},
                             "by_step": {}}},
               "cost": {n: {"rows": 2, "generated_tokens": 4, "steps": 1, "loss": None, "seconds": {"generate": 1.0}}
                        for n in ("dataset", "greedy")},
               "lossless": {}, "this_run": {"seconds": 10.0, "stages_seconds": 9.5}}
    text = table(figures)
    assert "nan" not in text.lower()
    assert "dataset  tau - [-]" in text and "no step proposed a draft token" in text
    assert "tau(greedy) - tau(dataset) = - [-]: nothing to compare" in text
    assert "the pilot's own 0 s (5.0%)" in text
