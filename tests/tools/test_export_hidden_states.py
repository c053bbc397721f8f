"""`export --format specforge-offline|speculators-offline|modelopt-offline` on a real OUT
with hidden states (8-layer tiny Qwen3, float32, layer ids [2, 4, 5, 8]).

Each export is loaded back the way its peer's loader reads it (the loader's own steps:
file discovery, load call, keys, squeezes, shifts; the peer file is named at each), and
its values are compared with the OUT read through eagle_data.storage.hidden_states and
with data/'s input_ids / loss_mask. The post-norm final state is compared with what
transformers computes for the target (a copy whose final-norm weight is not all ones)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from support import data_rows, hidden_features
from eagle_data.__main__ import main
from eagle_data.errors import EagleDataError
from eagle_data.storage.files import filesystem
from eagle_data.storage.hidden_states import Index
from eagle_data.tools import export as ex

# Every test reads `hidden_out`, an OUT the whole job makes (about a minute): not in `make test-fast`.
pytestmark = pytest.mark.slow

FORMATS = ("specforge-offline", "speculators-offline", "modelopt-offline")
L, H = 8, 64


@pytest.fixture(scope="module")
def model(deep_qwen3, tmp_path_factory) -> Path:
    """The target with a final-norm weight that is not all ones (a fresh Qwen3's is), so
    the weight's part in the conversion is tested. The final norm changes no pre-norm
    state, so the OUT's stored states are this model's too."""
    dest = tmp_path_factory.mktemp("norm-model") / "deep-qwen3"
    shutil.copytree(deep_qwen3, dest)
    weights = load_file(dest / "model.safetensors")
    weights["model.norm.weight"] = torch.linspace(0.5, 2.0, H)
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


@pytest.fixture(scope="module")
def exported(hidden_out, model, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    root = tmp_path_factory.mktemp("offline")
    return {f: (root / f, ex.export(str(hidden_out), str(root / f), f, model=str(model))) for f in FORMATS}


@pytest.fixture(scope="module")
def rows(hidden_out) -> dict[str, dict]:
    return data_rows(hidden_out)


@pytest.fixture(scope="module")
def reference(hidden_out) -> dict[str, torch.Tensor]:
    fs, root = filesystem(str(hidden_out))
    assert Index.read(fs, f"{root}/hidden_states").layer_ids == [2, 4, 5, L]
    return hidden_features(hidden_out)


def post_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Qwen3RMSNorm as transformers writes it, in float32."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def order(dest: Path) -> list[str]:
    return json.loads((dest / ex.MARKER).read_text())["sample_ids"]


def test_counts(exported, rows, reference):
    for fmt, (dest, counts) in exported.items():
        assert counts["rows"] == len(reference) == len(rows) and counts["without_hidden_states"] == 0, fmt
        assert counts["aux_layer_ids"] == [2, 4, 5] and counts["final_layer_id"] == L
        assert counts["final_norm"] == ("pre" if fmt == "speculators-offline" else "post")
        assert sorted(order(dest)) == sorted(reference)
        assert not [p for p in dest.parent.iterdir() if p.name.startswith(".")]  # no temporary left


# ---------------------------------------------------------------------------- SpecForge

def specforge_list_local_files(path) -> list[str]:
    # specforge/data/preprocessing.py list_local_files: os.walk, .ckpt / .ckpt.gz, sorted
    found = [os.path.join(r, f) for r, _, files in os.walk(path) for f in files]
    return sorted(f for f in found if f.endswith((".ckpt", ".ckpt.gz")))


def specforge_process_data(data: dict, max_len: int) -> dict:
    # specforge/data/preprocessing.py OfflineEagle3Dataset.process_data (no transform)
    hidden_state = data["aux_hidden_state"].squeeze(0)[:max_len][None, :]
    target = data["hidden_state"].squeeze(0)[:max_len][None, :]
    input_ids = data["input_ids"][:max_len][None, :]
    loss_mask = data["loss_mask"][:max_len][None, :]
    loss_mask[0, -1] = 0
    return {"attention_mask": torch.ones_like(loss_mask, dtype=torch.long), "loss_mask": loss_mask,
            "target": target, "hidden_state": hidden_state, "input_ids": input_ids}


def test_specforge_offline_loads_as_offline_eagle3_dataset(exported, rows, reference, model):
    dest, _ = exported["specforge-offline"]
    ids = order(dest)
    files = specforge_list_local_files(dest)
    assert len(files) == len(ids)
    weight = load_file(model / "model.safetensors")["model.norm.weight"]
    for path in files:
        i = int(Path(path).name.removeprefix("data_").removesuffix(".ckpt"))
        assert Path(path).parent.name == "rows_0-2000"  # HiddenStatesGenerator._get_file_path
        sid = ids[i]
        # OfflineEagle3Dataset._open_file: torch.load(path, weights_only=False, mmap=True)
        raw = torch.load(path, weights_only=False, mmap=True)
        assert set(raw) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
        assert raw["input_ids"].dtype == raw["loss_mask"].dtype == torch.int64
        t = len(rows[sid]["input_ids"])
        assert raw["aux_hidden_state"].shape == (1, t, 3 * H) and raw["hidden_state"].shape == (1, t, H)
        item = specforge_process_data(raw, max_len=2048)
        assert item["input_ids"][0].tolist() == rows[sid]["input_ids"]
        assert item["loss_mask"][0, :-1].tolist() == rows[sid]["loss_mask"][:-1]
        ref = reference[sid]
        assert torch.equal(item["hidden_state"][0], torch.cat([ref[:, 0], ref[:, 1], ref[:, 2]], dim=-1))
        torch.testing.assert_close(item["target"][0], post_norm(ref[:, 3], weight), rtol=1e-6, atol=1e-6)


def test_specforge_groups_files_by_2000(tmp_path):
    sample = ex.OfflineSample({"sample_id": "s", "input_ids": torch.arange(3).numpy(),
                               "loss_mask": torch.ones(3, dtype=torch.int8).numpy(),
                               "hidden_states": torch.randn(3, 4, H)}, aux=[0, 1, 2], final=3)
    ex.write_specforge(str(tmp_path), 4321, sample, ex.FinalNorm(torch.ones(H), 1e-6, "test"))
    assert (tmp_path / "rows_4000-6000" / "data_4321.ckpt").is_file()


# --------------------------------------------------------------------------- speculators

def test_speculators_offline_loads_as_arrow_dataset(exported, rows, reference):
    from datasets import load_from_disk

    dest, _ = exported["speculators-offline"]
    ids = order(dest)
    # src/speculators/train/data.py ArrowDataset: load_from_disk(datapath), seq_len for
    # _compute_approx_lengths, FileTransfer(datapath / "hidden_states").get_cached(i)
    data = load_from_disk(str(dest))
    assert len(data) == len(ids)
    assert list(data.with_format(None)["seq_len"]) == [len(rows[s]["input_ids"]) for s in ids]
    for index in range(len(data)):
        sid = ids[index]
        loaded_hs = load_file(dest / "hidden_states" / f"hs_{index}.safetensors")  # hs_connectors transfer.py
        assert set(loaded_hs) == {"hidden_states", "token_ids"}
        # check_hidden_states (data_generation/offline.py) and ArrowDataset._get_raw_data's torch.equal
        assert loaded_hs["token_ids"].tolist() == data[index]["input_ids"].tolist()
        assert torch.equal(loaded_hs["token_ids"], data[index]["input_ids"])
        assert loaded_hs["hidden_states"].shape[0] == len(data[index]["input_ids"])
        raw = {"hidden_states": loaded_hs["hidden_states"][:, :-1].flatten(1),
               "input_ids": loaded_hs["token_ids"],
               "verifier_last_hidden_states": loaded_hs["hidden_states"][:, -1],
               "loss_mask": data[index]["loss_mask"]}
        ref = reference[sid]
        assert raw["input_ids"].tolist() == rows[sid]["input_ids"]
        assert raw["loss_mask"].dtype == torch.int64 and raw["loss_mask"].tolist() == rows[sid]["loss_mask"]
        assert raw["hidden_states"].shape == (len(ref), 3 * H)
        assert torch.equal(raw["hidden_states"], ref[:, :3].flatten(1))
        assert torch.equal(raw["verifier_last_hidden_states"], ref[:, 3])  # pre-norm, as vLLM gives it


# ------------------------------------------------------------------------ Model-Optimizer

def test_modelopt_offline_loads_as_offline_supervised_dataset(exported, rows, reference, model):
    dest, _ = exported["modelopt-offline"]
    # examples/speculative_decoding/eagle_utils.py: Path(offline_data_path).rglob("*.pt")
    files = [str(p) for p in Path(dest).rglob("*.pt")]
    assert sorted(Path(f).stem for f in files) == sorted(reference)
    weight = load_file(model / "model.safetensors")["model.norm.weight"]
    for path in files:
        # modelopt/torch/speculative/eagle/utils.py OfflineSupervisedDataset.__getitem__
        offline_data = torch.load(path, weights_only=True)
        labels = torch.full_like(offline_data["input_ids"], -100)
        labels[..., :-1] = offline_data["input_ids"][..., 1:]
        loss_mask = offline_data["loss_mask"].to(offline_data["input_ids"].dtype)  # answer_only_loss=True
        prenorm = bool(offline_data.get("hidden_states_prenorm", False))
        sid = offline_data["conversation_id"]
        assert sid == Path(path).stem  # written as {conversation_id}.pt, as compute_hidden_states_hf.py
        assert offline_data["input_ids"].dtype == torch.int64 and offline_data["input_ids"].tolist() == rows[sid]["input_ids"]
        assert loss_mask.tolist() == rows[sid]["loss_mask"] and labels[:-1].tolist() == rows[sid]["input_ids"][1:]
        assert not prenorm
        ref = reference[sid]
        assert torch.equal(offline_data["aux_hidden_states"], torch.cat([ref[:, 0], ref[:, 1], ref[:, 2]], dim=-1))
        torch.testing.assert_close(offline_data["hidden_states"], post_norm(ref[:, 3], weight), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------- the post-norm conversion

def test_post_norm_final_state_is_transformers_hidden_states_L(exported, model):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    assert not torch.allclose(target.model.norm.weight, torch.ones(H))
    spec_dest, modelopt_dest = exported["specforge-offline"][0], exported["modelopt-offline"][0]
    ids = order(spec_dest)
    for i in (0, len(ids) - 1):
        spec = torch.load(spec_dest / "rows_0-2000" / f"data_{i}.ckpt", weights_only=False)
        with torch.no_grad():
            hf = target(input_ids=spec["input_ids"][None], output_hidden_states=True).hidden_states
        assert len(hf) == L + 1
        torch.testing.assert_close(spec["hidden_state"][0], hf[L][0], rtol=1e-5, atol=1e-5)
        opt = torch.load(modelopt_dest / f"{ids[i]}.pt", weights_only=True)
        torch.testing.assert_close(opt["hidden_states"], hf[L][0], rtol=1e-5, atol=1e-5)
        for slot, k in enumerate([2, 4, 5]):  # the aux states too are HF's hidden_states[k]
            torch.testing.assert_close(spec["aux_hidden_state"][0, :, slot * H:(slot + 1) * H], hf[k][0],
                                       rtol=1e-4, atol=1e-4)


def test_final_norm_is_read_from_the_models_files_or_refused(model, tmp_path):
    norm = ex.final_norm(str(model))
    assert torch.equal(norm.weight, torch.linspace(0.5, 2.0, H)) and norm.eps == 1e-6
    x = torch.randn(5, H, dtype=torch.bfloat16)
    assert norm(x).dtype == torch.bfloat16
    torch.testing.assert_close(norm(x), post_norm(x.float(), norm.weight).to(torch.bfloat16))
    no_norm = tmp_path / "no-norm"
    shutil.copytree(model, no_norm)
    weights = load_file(no_norm / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, no_norm / "model.safetensors")
    with pytest.raises(EagleDataError, match="no final-norm weight"):
        ex.final_norm(str(no_norm))
    config = json.loads((no_norm / "config.json").read_text())
    (no_norm / "config.json").write_text(json.dumps({**config, "model_type": "gemma3"}))
    with pytest.raises(EagleDataError, match="1 \\+ weight"):
        ex.final_norm(str(no_norm))
    with pytest.raises(EagleDataError, match="not a model folder"):
        ex.final_norm(str(tmp_path / "nothing-here"))


# ------------------------------------------------------- filters, missing states, DEST

def test_filters_and_samples_without_hidden_states(hidden_out, model, rows, tmp_path):
    copy = tmp_path / "out"
    shutil.copytree(hidden_out, copy)
    shard = sorted((copy / "hidden_states").glob("*.safetensors"))[0]
    with safe_open(shard, framework="pt") as f:
        gone = set(f.keys())
    shard.unlink()
    counts = ex.export(str(copy), str(tmp_path / "d"), "modelopt-offline", model=str(model))
    assert gone and counts["without_hidden_states"] == len(gone) and counts["rows"] == len(rows) - len(gone)
    assert {p.stem for p in (tmp_path / "d").glob("*.pt")} == set(rows) - gone
    first = rows[sorted(set(rows) - gone)[0]]  # a (source, finish reason) pair that keeps a row
    kept = {s for s, r in rows.items()
            if (r["source"], r["finish_reason"]) == (first["source"], first["finish_reason"])} - gone
    counts = ex.export(str(copy), str(tmp_path / "f"), "speculators-offline",
                       finish_reason=[first["finish_reason"]], source=[first["source"]])
    assert counts["rows"] == len(kept) > 0 and sorted(order(tmp_path / "f")) == sorted(kept)


def test_an_empty_export_is_written_where_the_format_can_hold_it(hidden_out, model, tmp_path):
    """datasets cannot load an empty saved dataset, so speculators' format refuses 0 rows
    even with --allow-empty, naming why; the file formats write an empty folder."""
    counts = ex.export(str(hidden_out), str(tmp_path / "m"), "modelopt-offline", model=str(model),
                       source=["no-such-source"], allow_empty=True)
    assert counts["rows"] == 0 and order(tmp_path / "m") == []
    with pytest.raises(EagleDataError, match="speculators-offline cannot hold 0 samples"):
        ex.export(str(hidden_out), str(tmp_path / "s"), "speculators-offline", source=["no-such-source"],
                  allow_empty=True)
    assert not (tmp_path / "s").exists() and not list(tmp_path.glob(".s.*"))


def test_dest_is_never_something_else_replaced(hidden_out, model, tmp_path, capsys):
    dest = tmp_path / "dest"
    args = ["export", str(hidden_out), str(dest), "--format", "modelopt-offline", "--model", str(model)]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["rows"] > 0
    (dest / "stale.pt").write_bytes(b"")
    with pytest.raises(EagleDataError, match="exists; pass --overwrite"):
        ex.export(str(hidden_out), str(dest), "modelopt-offline", model=str(model))
    ex.export(str(hidden_out), str(dest), "modelopt-offline", model=str(model), overwrite=True)
    assert not (dest / "stale.pt").exists()  # replaced whole

    (tmp_path / "file").write_text("mine")
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "x").write_text("mine")
    (tmp_path / "link").symlink_to(dest, target_is_directory=True)
    for name, why in (("file", "not a folder"), ("theirs", "did not write"), ("link", "symlink")):
        with pytest.raises(EagleDataError, match=why):
            ex.export(str(hidden_out), str(tmp_path / name), "modelopt-offline", model=str(model), overwrite=True)
    assert (tmp_path / "file").read_text() == "mine" and (tmp_path / "theirs" / "x").read_text() == "mine"
    assert (tmp_path / "link").resolve() == dest and (dest / ex.MARKER).is_file()
    with pytest.raises(EagleDataError, match="not a folder"):
        ex.export(str(hidden_out), str(tmp_path / "file" / "sub"), "modelopt-offline", model=str(model))


def test_a_failed_export_leaves_nothing(hidden_out, model, tmp_path, monkeypatch):
    calls = []

    def failing(dest, i, sample, norm):
        calls.append(i)
        if i == 2:
            raise OSError("disk full")
        ex.write_modelopt(dest, i, sample, norm)

    monkeypatch.setitem(ex.OFFLINE_FORMATS, "modelopt-offline", (failing, True, None))
    with pytest.raises(OSError, match="disk full"):
        ex.export(str(hidden_out), str(tmp_path / "dest"), "modelopt-offline", model=str(model))
    assert calls == [0, 1, 2] and list(tmp_path.iterdir()) == []


def test_refusals(hidden_out, model, tmp_path):
    copy = tmp_path / "out"
    shutil.copytree(hidden_out, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["phases"]["hidden_states"]["features"]["num_layers"] = 9  # as if id 8 were not the final one
    (copy / "manifest.json").write_text(json.dumps(manifest))
    for fmt in FORMATS:
        with pytest.raises(EagleDataError, match="needs the final state \\(layer id 9\\)"):
            ex.export(str(copy), str(tmp_path / fmt), fmt, model=str(model))
    with pytest.raises(EagleDataError, match="writes a local folder"):
        ex.export(str(hidden_out), "s3://bucket/x", "specforge-offline", model=str(model))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
