"""The acceptance job (`python -m ray_jobs.acceptance`) on real parts: the tiny 8-layer
Qwen3 as target on vLLM's CPU build, a draft the project's trainer wrote (`trained_draft`),
the bundled sample's prompts rendered with the real Qwen3 chat template; and its refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from support import REPO, attached, job_config, job_settings, ray_processes, run_module
from eagle_data.errors import ConfigError, ForeignFiles, MissingInput, NotWritable
from eagle_data.evaluation.acceptance import SAMPLED_SPEC_DECODE, check, sampled_on_cpu

# As tests/vllm's: engine.device=cpu, fp32, one engine thread, small KV cache and batches.
VLLM = dict(engine__backend="vllm", engine__device="cpu", engine__num_cpus=1, engine__cpu_kv_cache_gib=0.25,
            engine__batch_size=4, engine__max_concurrent_batches=4, engine__resource_wait_s=30, engine__cpu_threads=1,
            engine__engine_kwargs={"dtype": "float32", "enforce_eager": True, "max_num_seqs": 8})


REPLICA = "MapWorker(MapBatches(VLLMEngine))"


def below(replica: int) -> list:
    """A vLLM replica's actor process and every process below it (EngineCore, Worker, the
    resource tracker), as psutil processes: once the replica is gone, what it left is no
    longer below the raylet, so it is looked at by these."""
    import psutil

    try:
        process = psutil.Process(replica)
        return [process, *process.children(recursive=True)]
    except psutil.Error:
        return []


def alive(processes: list) -> list[str]:
    import psutil

    left = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {' '.join(p.cmdline())[:40]}")
        except psutil.Error:
            pass
    return left


def left_after(processes: list, timeout_s: float) -> list[str]:
    """Those of `processes` still alive `timeout_s` from now (returns as soon as none is);
    killed then, never left to the rest of the session."""
    deadline = time.monotonic() + timeout_s
    while alive(processes) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = alive(processes)
    for p in processes:
        try:
            p.kill()
        except Exception:
            pass
    return left


class Job:
    """The acceptance job as a user runs it, in a driver of its own on the session's Ray
    (`ray job submit`'s case: Ray stops its actors when the driver ends), its log in a file."""

    def __init__(self, settings: dict, tmp_path, ray_local, name: str):
        import yaml

        config = tmp_path / "acceptance.yaml"
        config.write_text(yaml.safe_dump(settings))
        self.log = tmp_path / f"{name}.log"
        with open(self.log, "w") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "ray_jobs.acceptance", "--config", str(config)],
                                            cwd=REPO, env={**attached(ray_local), "PYTHONPATH": str(REPO)},
                                            stdout=log, stderr=subprocess.STDOUT)

    def wait_for(self, what: str, found, timeout_s: float = 900):
        """found()'s first true value, looked at every 0.1 s while the job runs."""
        deadline = time.monotonic() + timeout_s
        while self.process.poll() is None and time.monotonic() < deadline:
            value = found()
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"{what}: not seen (the job {'exited' if self.process.poll() is not None else 'runs'}):\n"
                             + self.log.read_text()[-3000:])

    def stop(self, signum: int, timeout_s: float = 120) -> tuple[int, str]:
        self.process.send_signal(signum)
        try:
            self.process.wait(timeout=timeout_s)
        finally:
            if self.process.poll() is None:
                self.process.kill()
        return self.process.returncode, self.log.read_text()


def draft_engine(job: Job) -> list:
    """Once the job has said that the draft's pass starts and that pass's replica (one that
    was not up before: the target's may still be exiting) runs vLLM's Worker: the replica and
    every process below it."""
    earlier: set[int] = set()

    def draft_pass_started() -> bool:
        earlier.update(ray_processes(REPLICA))
        return "acceptance: draft trained: measuring" in job.log.read_text()

    job.wait_for("the draft's pass", draft_pass_started)
    earlier.update(ray_processes(REPLICA))  # the target's replica, up until the line, may outlive it

    def started() -> list | None:
        import psutil

        for replica in set(ray_processes(REPLICA)) - earlier:
            processes = below(replica)
            for p in processes:
                try:
                    if "VLLM::Worker" in " ".join(p.cmdline()):
                        return processes
                except psutil.Error:
                    pass
        return None

    return job.wait_for("the draft's engine", started)


@pytest.mark.vllm
@pytest.mark.slow
def test_the_job_measures_a_trained_draft_at_two_temperatures_survives_its_stops_and_goes_on(
        ray_local, trained_draft, deep_qwen3, tmp_path):
    """The acceptance job on the trained draft (k = 3) at temperatures 0 and 0.7, as a user
    runs it, three times on one report folder:

    1. SIGTERMed during the draft's pass, the target's pass kept: exit 143 and one `error:`
       line (issue 63: exit 15, no line, ~35 s); nothing of the draft's engine (vLLM's
       EngineCore and Worker) left 30 s later. (A driver SIGKILLed: its vLLM processes end
       with their replica, as tests/vllm/test_vllm_engine.py::test_faults_on_vllm checks,
       the same watchdog for every job: issue 63's VLLM::Worker that outlived the driver.)
    2. The same command again: the target's pass is reused (said in the log), the draft's
       measured, the report written. At 0, every output with the draft equals the target's own
       (lossless); at both, vLLM's per-step counts make each output, tau and the acceptance by
       position are in range: sampled speculative decoding runs on vLLM's CPU build (its
       rejection sampler's kernels replaced, vllm/v1/worker/cpu_model_runner.py).
    3. Once more: every pass reused, no engine started, the same report.

    A step budget of 64 tokens (engine.max_model_len 64) with chunked prefill on would split
    the prompts' prefills (8 prompts of 16-38 tokens, at 2 temperatures), and a split seeded
    prefill crashes vLLM's CPU build without end; the job turns chunked prefill off for sampled
    passes on CPU (acceptance.sampled_on_cpu), so this run would hang without it."""
    save, _ = trained_draft
    settings = job_settings(tmp_path / "prompts", deep_qwen3, source__sample=10, sampling__max_tokens=16,
                            **{**VLLM, "engine__max_model_len": 64, "engine__engine_kwargs": {
                                **VLLM["engine__engine_kwargs"], "max_num_batched_tokens": 64}})
    settings["acceptance"] = {"drafts": {"trained": str(save / "final")}, "path": str(tmp_path / "report"),
                              "bootstrap": 200, "temperatures": [0.0, 0.7]}
    passes = tmp_path / "report" / "passes"

    # 1. SIGTERM during the draft's pass.
    job = Job(settings, tmp_path, ray_local, "stopped")
    engine = draft_engine(job)
    assert (passes / "target.json").exists()  # kept before the draft's pass started
    stopped = time.monotonic()
    code, log = job.stop(signal.SIGTERM)
    print(f"\nSIGTERM during the draft's pass: the job exited {time.monotonic() - stopped:.1f} s after the signal")
    assert code == 143, log[-3000:]
    assert "acceptance: the target alone: measuring" in log
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert errors == [log.strip().splitlines()[-1]] == [
        "error: stopped by SIGTERM; the finished passes are kept in acceptance.path: run the same command to go on"]
    assert "Traceback" not in log, log[-3000:]
    left = left_after(engine, 30)
    assert left == [], f"the stopped job's engine processes still run 30 s after: {left}"
    assert not any(p.name.startswith("draft-") for p in passes.iterdir())

    # 2. The same command goes on.
    done = run_module("ray_jobs.acceptance", settings, tmp_path, ray_local)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "acceptance: the target alone: reusing the pass finished at" in done.stderr
    assert "acceptance: draft trained: measuring 16 requests" in done.stderr
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    prompts = report["prompts"]
    assert prompts == 8  # the sample's 10 rows, 2 of them skipped (bad_schema)
    assert report["temperatures"] == [0.0, 0.7] and "temperature 0 only" in report["lossless"]
    draft = report["drafts"]["trained"]
    assert draft["by_temperature"]["0"]["lossless"] == {"equal": prompts, "of": prompts, "mismatches": []}
    assert "lossless" not in draft["by_temperature"]["0.7"]
    assert draft["tokens_per_s"] > 0 and report["target"]["tokens_per_s"] > 0 and draft["speedup"] > 0
    rows = [json.loads(line) for line in (tmp_path / "report" / "per_prompt.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * prompts
    for temperature, key in ((0.0, "0"), (0.7, "0.7")):
        figures = draft["by_temperature"][key]
        assert 1 <= figures["tau_95"][0] <= figures["tau"] <= figures["tau_95"][1] <= 4, (key, figures)
        by_position = figures["acceptance_by_position"]
        assert all(0 <= a <= 1 for a in by_position) and by_position == sorted(by_position, reverse=True)
        at_t = [r for r in rows if r["temperature"] == temperature]
        assert len(at_t) == prompts
        for r in at_t:
            made = 1 + sum(a + 1 for a in r["spec_accepted"])  # the prefill's token, then accepted + 1 a step
            assert len(r["generated_tokens"]) <= made <= len(r["generated_tokens"]) + 3, r  # the last may overshoot
            assert all(d == 3 for d in r["spec_drafted"][:-1])
        assert sum(len(r["spec_accepted"]) for r in at_t) == figures["steps"]
    sampled = {r["sample_id"]: r["generated_tokens"] for r in rows if r["temperature"] == 0.7}
    greedy = {r["sample_id"]: r["generated_tokens"] for r in rows if r["temperature"] == 0.0}
    assert sampled != greedy  # sampled: not the greedy answers
    assert (tmp_path / "report" / "acceptance.png").stat().st_size > 1000
    assert "temperature 0.7 (sampled" in done.stdout and f"lossless {prompts}/{prompts}" in done.stdout

    # 3. Nothing left to measure.
    again = run_module("ray_jobs.acceptance", settings, tmp_path, ray_local)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "draft trained: reusing the pass finished at" in again.stderr and "measuring" not in again.stderr
    assert "VLLM" not in again.stderr  # no engine started
    assert json.loads((tmp_path / "report" / "report.json").read_text())["drafts"] == report["drafts"]


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
    with pytest.raises(ConfigError, match="sampling.max_tokens 1 leaves a draft nothing to propose"):
        check(job_config(tmp_path / "prompts", tiny_qwen3, **VLLM, sampling__max_tokens=1,
                         acceptance__drafts={"d": fits}, acceptance__path=str(tmp_path / "report")))
    # A report folder that cannot be made or written: found at start (was: after every pass, a traceback).
    (tmp_path / "a-file").write_text("x")
    for path, message in [("/proc/eagle-data-report", "cannot be written"), ("/sys/report", "cannot be written"),
                          (str(tmp_path / "a-file" / "report"), "cannot be written"),
                          (str(tmp_path / "a-file"), "is a file: give a folder")]:
        with pytest.raises(NotWritable, match=f"acceptance.path {path} {message}"):
            check(cfg(path=path))
    # On CPU, sampled passes run with unsplit prefills and the rejection sampler made right;
    # engine kwargs that would undo either are refused.
    sampled = dict(temperatures=[0.0, 0.7])
    assert sampled_on_cpu(cfg(**sampled)) == {"enable_chunked_prefill": False, "max_num_batched_tokens": 2048,
                                              "worker_extension_cls": SAMPLED_SPEC_DECODE}
    assert sampled_on_cpu(cfg()) == {}
    for kwargs, message in [({"enable_chunked_prefill": True}, "enable_chunked_prefill True"),
                            ({"max_num_batched_tokens": 512}, "max_num_batched_tokens 512 .* at least "
                                                              r"engine.max_model_len \(1024\)"),
                            ({"worker_extension_cls": "my.Extension"}, "worker_extension_cls 'my.Extension'")]:
        given = job_config(tmp_path / "prompts", tiny_qwen3, **{**VLLM, "engine__engine_kwargs": kwargs},
                           acceptance__drafts={"d": fits}, acceptance__path=str(tmp_path / "report"),
                           acceptance__temperatures=[0.7])
        with pytest.raises(ConfigError, match=message):
            check(given)
    (tmp_path / "report").mkdir(exist_ok=True)
    (tmp_path / "report" / "notes.txt").write_text("a user's file")
    with pytest.raises(ForeignFiles, match="holds files the acceptance job did not write"):
        check(cfg())
    with pytest.raises(ConfigError, match="acceptance.num_speculative_tokens: Input should be greater than or equal to 1"):
        cfg(num_speculative_tokens=0)
    with pytest.raises(ConfigError, match="the acceptance job runs vLLM's speculative decoding"):
        check(job_config(tmp_path / "prompts", tiny_qwen3, acceptance__drafts={"d": str(tmp_path / "ok")},
                         acceptance__path=str(tmp_path / "report2")))


@pytest.mark.slow
def test_a_draft_cut_in_its_tensors_is_refused_in_one_line_before_any_engine(ray_local, trained_draft, deep_qwen3,
                                                                            tmp_path):
    """The job as a user runs it, with a copy of the trained draft cut 1,000 bytes short:
    exit 2 and one `error:` line naming the file and what is wrong, before Ray or an engine
    starts. Was (issue 63): the engine started, then `Engine core initialization failed` with
    5 tracebacks and a hint naming model.path."""
    import shutil

    save, _ = trained_draft
    draft = shutil.copytree(save / "final", tmp_path / "cut")
    weights = draft / "model.safetensors"
    size = weights.stat().st_size
    os.truncate(weights, size - 1000)
    settings = job_settings(tmp_path / "prompts", deep_qwen3, source__sample=10, **VLLM)
    settings["acceptance"] = {"drafts": {"cut": str(draft)}, "path": str(tmp_path / "report")}
    done = run_module("ray_jobs.acceptance", settings, tmp_path, ray_local)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: acceptance.drafts.cut {draft}: {weights} is truncated ({size - 1000} bytes; its header says {size}); "
        "copy or save the draft again, or give another (the draft trainer's final/ or a step-<N>/ checkpoint)")
    assert "Traceback" not in done.stderr and "VLLM" not in done.stderr and "Ray" not in done.stderr, done.stderr
    assert not (tmp_path / "prompts").exists() and not (tmp_path / "report").exists()  # nothing started or made


def test_every_flag_the_jobs_messages_name_is_accepted(tmp_path, own_signal_handlers, capsys):
    """The prompts phase's messages (a config that changed, a dataset that changed, no prompt
    left) name `--fresh`, `--fresh --phase prompts`, `--keep-prompts` and `--allow-empty`;
    the acceptance job refused them all (`unrecognized arguments`, issue 63). Each is taken
    (the run then stops at the missing config, exit 2, not at the arguments)."""
    from ray_jobs.acceptance import main

    for flags in (["--fresh"], ["--fresh", "--phase", "prompts"], ["--keep-prompts"], ["--allow-empty"]):
        assert main(["--config", str(tmp_path / "missing.yaml"), *flags]) == 2, flags
        said = capsys.readouterr().err
        last = said.strip().splitlines()[-1]
        assert "unrecognized arguments" not in said and last.startswith("error: ") and "missing.yaml" in last, said


@pytest.mark.slow
def test_no_prompt_left_exits_3_with_a_hint_that_works(ray_local, deep_qwen3, trained_draft, tmp_path):
    """Every row of the held-out set unusable: exit 3, naming --allow-empty; with it, exit 0
    and nothing measured (no engine, no report)."""
    from support import write_jsonl

    save, _ = trained_draft
    dataset = write_jsonl(tmp_path / "held-out.jsonl", [{"conversations": [{"from": "gpt", "value": "no question"}]}] * 3)
    settings = job_settings(tmp_path / "prompts", deep_qwen3, dataset=dataset, **VLLM)
    settings["acceptance"] = {"drafts": {"trained": str(save / "final")}, "path": str(tmp_path / "report")}
    done = run_module("ray_jobs.acceptance", settings, tmp_path, ray_local)
    assert done.returncode == 3, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: 0 prompts: all 3 selected rows") and "--allow-empty" in last, last
    import yaml

    config = tmp_path / "acceptance.yaml"
    config.write_text(yaml.safe_dump(settings))
    allowed = subprocess.run([sys.executable, "-m", "ray_jobs.acceptance", "--config", str(config), "--allow-empty"],
                             cwd=REPO, env={**attached(ray_local), "PYTHONPATH": str(REPO)}, capture_output=True,
                             text=True, timeout=600)
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert "nothing measured, no report written" in allowed.stdout and "VLLM" not in allowed.stderr
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == ["passes"]
