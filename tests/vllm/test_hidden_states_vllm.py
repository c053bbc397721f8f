"""The hidden-states phase on vLLM's CPU build (extract_hidden_states + the connector, through
Ray's vLLM stage), as a user runs it (`--phase hidden_states` on an OUT), against the same
phase on transformers, on the 8-layer tiny Qwen3 at the default layer ids [2, 4, 5, 8].

The OUT's rows share a long system prompt (prompts of ~150 tokens, the first ~100 shared),
and vLLM runs with prefix caching on (blocks of 32, vLLM's CPU attention takes multiples
of 32) and prefill chunks of 32 tokens, so the features also cover cache hits and chunked
prefill (vLLM #44485: prefix caching once gave fewer rows than tokens). One engine run, float32
at tensor parallel 2 (production's layout: only rank 0's connector writes, with the full
hidden size), on a model with 2 attention heads (one per rank); the transformers phase,
itself checked against HF's own hidden_states in tests/whole_job/test_hidden_states.py, is
the reference. bfloat16 on vLLM, at tensor parallel 1, is checked the same way on the
README's `--phase hidden_states` command (tests/test_readme.py), which runs that engine
anyway."""

from __future__ import annotations

import shutil

import pytest

from support import (STATES_TOLERANCE, build_tiny_model, hidden_features, job_config, states_gap, stream_into_trainer,
                     write_jsonl)
from eagle_data.job.phases.run import run
from eagle_data.storage.folder import Output
from eagle_data.storage.hidden_states import Index
from eagle_data.tools.verify import verify

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SYSTEM = ("You are a careful assistant. Answer in plain words, check every number twice, name your sources, "
          "and say so when you do not know. Keep answers short unless asked for detail. ") * 3
QUESTIONS = ["What is a prime number?", "Why is the sky blue?", "How do bees make honey?",
             "What does a compiler do?", "Name three rivers in Europe.", "How far is the Moon?",
             "What is entropy, in one line?", "Why do cats purr?"]
# One engine thread: a tiny model gains nothing from a second (docs/development.md).
VLLM = dict(engine__backend="vllm", engine__device="cpu", engine__num_cpus=1, engine__cpu_kv_cache_gib=0.25,
            engine__batch_size=4, engine__max_concurrent_batches=4, engine__resource_wait_s=30, engine__cpu_threads=1,
            engine__engine_kwargs={"enforce_eager": True, "max_num_seqs": 8, "enable_prefix_caching": True,
                                   "block_size": 32, "max_num_batched_tokens": 32})


def settings(out, model, dataset, dtype="float32", **extra):
    return job_config(out, model, dataset, preset={"sampling__max_tokens": 12, "engine__batch_size": 4},
                      hidden_states__dtype=dtype, **extra)


@pytest.fixture(scope="module")
def deep_2heads(tmp_path_factory, qwen3_tokenizer_dir):
    """8 layers (EAGLE-3's default ids [2, 4, 5, 8]), head_dim 64, 2 heads for tensor parallel 2."""
    return build_tiny_model(qwen3_tokenizer_dir, tmp_path_factory.mktemp("model") / "deep-2heads", head_dim=64,
                            layers=8, heads=2)


@pytest.fixture(scope="module")
def shared_prefix_out(ray_local, deep_2heads, tmp_path_factory):
    """data/ made by the job (transformers), then the transformers hidden-states phase."""
    root = tmp_path_factory.mktemp("hs-vllm")
    dataset = write_jsonl(root / "shared-prefix.jsonl", [
        {"conversations": [{"from": "system", "value": SYSTEM}, {"from": "human", "value": q}], "source": "s"}
        for q in QUESTIONS])
    out = root / "transformers"
    run(settings(out, deep_2heads, dataset, hidden_states__enabled=True))
    return out, dataset


def test_vllm_phase_at_tensor_parallel_2_equals_the_transformers_phase(shared_prefix_out, deep_2heads, tmp_path):
    dtype, tensor_parallel = "float32", 2
    reference_out, dataset = shared_prefix_out
    out = tmp_path / "vllm"
    shutil.copytree(reference_out, out, ignore=shutil.ignore_patterns("hidden_states", "hidden_failed"))
    manifest = Output(str(out)).manifest  # the copy as it was before its hidden-states phase
    manifest.data["phases"].pop("hidden_states")
    manifest.save()
    # The node's scratch as a killed earlier run of this OUT left it, beside files not ours.
    ours = tmp_path / "scratch" / f"eagle-data-{manifest.out_id}"
    (ours / "20260101T000000-abcdef").mkdir(parents=True)
    (ours / "20260101T000000-abcdef" / "s-1.safetensors").write_bytes(b"left by a killed run")
    (ours / "notes").mkdir()
    (tmp_path / "scratch" / "someone-else.txt").write_text("not ours")
    counts = run(settings(out, deep_2heads, dataset, dtype, **{**VLLM, "engine__cpu_threads": None},
                          engine__tensor_parallel_size=tensor_parallel,
                          hidden_states__scratch_dir=str(tmp_path / "scratch")),
                 phase="hidden_states")["hidden_states"]
    assert counts["ok"] == counts["selected"] == len(QUESTIONS) and counts["failed_rows"] == 0
    assert verify(str(out))[0] == []
    # The connector's files were on the scratch, read back there and removed; on OUT only the shards.
    [run_folder] = [p for p in ours.iterdir() if p.name != "notes"]
    assert run_folder.name == Output(str(out)).manifest.data["phases"]["hidden_states"]["run_id"]
    assert list(run_folder.iterdir()) == [] and (ours / "notes").is_dir()
    assert (tmp_path / "scratch" / "someone-else.txt").read_text() == "not ours"
    assert {p.parent.name for p in out.rglob("*.safetensors")} == {"hidden_states"}

    want, got = hidden_features(reference_out), hidden_features(out)
    meta = Index.read(Output(str(out)).fs, str(out / "hidden_states"))
    assert meta.layer_ids == [2, 4, 5, 8] and meta.dtype == dtype
    assert all(w.shape[0] > 128 for w in want.values())  # longer than four 32-token blocks
    max_rel, min_cos = states_gap(got, want)
    print(f"{dtype}, tensor parallel {tensor_parallel}: largest relative difference {max_rel:.3g}, smallest cosine {min_cos:.7f}")
    rel_tol, cos_tol = STATES_TOLERANCE[dtype]
    assert max_rel <= rel_tol and min_cos >= cos_tol, (max_rel, min_cos)


def test_the_feature_stream_on_vllm_into_a_torch_trainer_equals_the_transformers_phase(ray_local, shared_prefix_out,
                                                                                       deep_2heads, tmp_path):
    """eagle_data.stream on vLLM (tensor parallel 1, prefix caching on: the shared system
    prompt hits the cache; whole prompts per step) into 2 Ray Train workers: every sample
    once, each within the vLLM phase's tolerances of the transformers phase's stored states."""
    reference_out, dataset = shared_prefix_out
    whole_prompts = {**VLLM, "engine__engine_kwargs": {**VLLM["engine__engine_kwargs"], "max_num_batched_tokens": 1024}}
    cfg = settings(reference_out, deep_2heads, dataset, **whole_prompts,
                   hidden_states__scratch_dir=str(tmp_path / "scratch"))
    ranks, report = stream_into_trainer(ray_local, reference_out, cfg, tmp_path, "stream-vllm", world_size=2)

    reference = hidden_features(reference_out)
    got = {item["sample_id"]: item["hidden_states"] for rank in ranks for item in rank}
    assert [len(r) for r in ranks] == [len(reference) // 2] * 2 and got.keys() == reference.keys()
    worst_relative, worst_cosine = states_gap(got, reference)
    assert worst_relative <= STATES_TOLERANCE["float32"][0] and worst_cosine >= STATES_TOLERANCE["float32"][1]
    assert report["epochs"] == {0: {"ok": len(reference), "failed": {}}}
    assert [p for p in (tmp_path / "scratch").rglob("*") if p.is_file()] == []  # each row's file taken, removed
