"""The acceptance job (`python -m ray_jobs.acceptance`) on real parts: the tiny 8-layer
Qwen3 as target on vLLM's CPU build, a draft the project's trainer wrote (`trained_draft`),
the bundled sample's prompts rendered with the real Qwen3 chat template; and its refusals."""

from __future__ import annotations

import json

import pytest

from support import job_config, job_settings, run_module
from eagle_data.errors import ConfigError, ForeignFiles, MissingInput
from eagle_data.evaluation.acceptance import check

# As tests/vllm's: engine.device=cpu, fp32, one engine thread, small KV cache and batches.
VLLM = dict(engine__backend="vllm", engine__device="cpu", engine__num_cpus=1, engine__cpu_kv_cache_gib=0.25,
            engine__batch_size=4, engine__max_concurrent_batches=4, engine__resource_wait_s=30, engine__cpu_threads=1,
            engine__engine_kwargs={"dtype": "float32", "enforce_eager": True, "max_num_seqs": 8})


@pytest.mark.vllm
@pytest.mark.slow
def test_the_job_measures_a_trained_draft_under_vllms_speculative_decoding_losslessly(ray_local, trained_draft,
                                                                                      deep_qwen3, tmp_path):
    """The target alone, then with the draft (k = 3): every output with the draft equals the
    target's own greedy output; per prompt, vLLM's counts make each output (the prefill's
    token, then accepted + 1 a step); tau and the acceptance by position are in range; the
    report, its files and the table."""
    save, _ = trained_draft
    settings = job_settings(tmp_path / "prompts", deep_qwen3, source__sample=10, sampling__max_tokens=16, **VLLM)
    settings["acceptance"] = {"drafts": {"trained": str(save / "final")}, "path": str(tmp_path / "report"),
                              "bootstrap": 200}
    done = run_module("ray_jobs.acceptance", settings, tmp_path, ray_local)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    draft = report["drafts"]["trained"]
    prompts = report["prompts"]
    assert prompts == 8  # the sample's 10 rows, 2 of them skipped (bad_schema)
    assert draft["lossless"] == {"equal": prompts, "of": prompts, "mismatches": []}
    assert 1 <= draft["tau_95"][0] <= draft["tau"] <= draft["tau_95"][1] <= 4
    by_position = draft["acceptance_by_position"]
    assert all(0 <= a <= 1 for a in by_position) and by_position == sorted(by_position, reverse=True)
    assert draft["tokens_per_s"] > 0 and report["target"]["tokens_per_s"] > 0 and draft["speedup"] > 0
    rows = [json.loads(line) for line in (tmp_path / "report" / "per_prompt.jsonl").read_text().splitlines()]
    assert len(rows) == prompts
    for r in rows:
        made = 1 + sum(a + 1 for a in r["spec_accepted"])  # the prefill's token, then accepted + 1 a step
        assert len(r["generated_tokens"]) <= made <= len(r["generated_tokens"]) + 3, r  # the last step may overshoot
        assert all(d == 3 for d in r["spec_drafted"][:-1])
    assert sum(len(r["spec_accepted"]) for r in rows) == draft["steps"]
    assert (tmp_path / "report" / "acceptance.png").stat().st_size > 1000
    assert "trained  all" in done.stdout and f"lossless {prompts}/{prompts}" in done.stdout


@pytest.mark.slow
def test_a_draft_for_another_target_is_refused_naming_what_differs(trained_draft, tiny_qwen3, tmp_path):
    """The trained draft (on the 8-layer Qwen3 of hidden size 64) against the 2-layer Qwen3 of
    hidden size 32: refused before any engine starts."""
    save, _ = trained_draft
    cfg = job_config(tmp_path / "prompts", tiny_qwen3, **VLLM, acceptance__drafts={"mine": str(save / "final")},
                     acceptance__path=str(tmp_path / "report"))
    with pytest.raises(ConfigError, match=r"acceptance.drafts.mine .* is a draft for another target than model.path: "
                                          r"its hidden size is 64, the target's 32; its aux layers \[2, 4, 5\] are "
                                          r"not all among the target's 2"):
        check(cfg)


def fake_draft(folder, vocab: int = 151669, **config) -> str:
    """A folder shaped as a speculators draft (config.json, a model.safetensors header with a
    t2d over the target's vocabulary: tiny_qwen3's embedding rows), for the checks that read
    only that."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3", **config}))
    header = json.dumps({"t2d": {"dtype": "BOOL", "shape": [vocab], "data_offsets": [0, vocab]}}).encode()
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(vocab))
    return str(folder)


def test_what_the_job_refuses_before_anything_starts(tiny_qwen3, tmp_path):
    fits = fake_draft(tmp_path / "ok", transformer_layer_config={"hidden_size": 32}, eagle_aux_hidden_state_layer_ids=[1])

    def cfg(**acceptance):
        given = {"drafts": {"d": fits}, "path": str(tmp_path / "report"), **acceptance}
        return job_config(tmp_path / "prompts", tiny_qwen3, **VLLM, **{f"acceptance__{k}": v for k, v in given.items()})

    check(cfg())  # a draft that fits: nothing to say
    cases = [
        (dict(drafts={}), ConfigError, "acceptance.drafts is empty"),
        (dict(path=None), ConfigError, "acceptance.path is not set"),
        (dict(drafts={"d": str(tmp_path)}), MissingInput, "acceptance.drafts.d .*: not a draft folder"),
        (dict(drafts={"d": fake_draft(tmp_path / "dflash", speculators_model_type="dflash")}), MissingInput,
         "not a speculators EAGLE-3 draft"),
        (dict(drafts={"d": fake_draft(tmp_path / "wide", transformer_layer_config={"hidden_size": 4096})}),
         ConfigError, "its hidden size is 4096, the target's 32"),
        (dict(drafts={"d": fake_draft(tmp_path / "kimi", vocab=163840)}), ConfigError,
         "its vocabulary maps a target of 163840 tokens, this one has 151669"),
    ]
    for acceptance, error, message in cases:
        with pytest.raises(error, match=message):
            check(cfg(**acceptance))
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "notes.txt").write_text("a user's file")
    with pytest.raises(ForeignFiles, match="holds files the acceptance job did not write"):
        check(cfg())
    with pytest.raises(ConfigError, match="acceptance.num_speculative_tokens: Input should be greater than or equal to 1"):
        cfg(num_speculative_tokens=0)
    with pytest.raises(ConfigError, match="the acceptance job runs vLLM's speculative decoding"):
        check(job_config(tmp_path / "prompts", tiny_qwen3, acceptance__drafts={"d": str(tmp_path / "ok")},
                         acceptance__path=str(tmp_path / "report2")))
