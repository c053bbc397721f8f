"""No benchmark can rot: each script in benchmarks/ runs at a smoke size (seconds to minutes,
a real model load for the vLLM ones; tests/smokes.py) and must exit 0, print its table, and
print figures that hold at any speed: read back from its JSON lines, its `RESULT {...}` line
and its markdown tables, the rows it counted are the rows the smoke size gives it, what it
checks by construction holds (the job's tokens are bare vLLM's, the stream's bound held, the
postprocess kept every token), and each figure is finite, with times positive and rounded or
sampled figures allowed to print 0. Nothing that depends on the machine's speed is compared
with anything: at a smoke size beside other tests the figures' values mean nothing. The full
sizes stay manual (each script's docstring, docs/performance.md)."""

from __future__ import annotations

import ast
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from smokes import MARKS, OWN_TEST, SMOKE
from support import REPO, attached, prompt_sets_missing


def test_every_benchmark_has_a_smoke_size_and_its_figures_checked():
    scripts = {p.name for p in (REPO / "benchmarks").glob("*.py") if not p.name.startswith("_")}
    assert scripts == set(SMOKE) | OWN_TEST == set(FIGURES) and not set(SMOKE) & OWN_TEST


def test_no_benchmark_imports_tests():
    """benchmarks/ imports the package, never tests/ (what both need lives in the package, such
    as eagle_data/tiny_models.py): no import of a module of tests/ (support, smokes, ...), and
    no path to tests/ spelled out (a "tests" path part), which is how a script puts it on sys.path."""
    modules = {p.stem for p in (REPO / "tests").glob("*.py")}
    found = []
    for path in sorted((REPO / "benchmarks").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                names = []
            found += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in modules]
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    re.fullmatch(r"(.*/)?tests/?", node.value):
                found.append(f"{path.name}:{node.lineno} names the folder tests/ ({node.value!r})")
    assert found == []


@pytest.mark.parametrize("script", [pytest.param(s, marks=MARKS.get(s, ())) for s in sorted(SMOKE)],
                         ids=lambda s: s.removesuffix(".py"))
def test_benchmark_runs_at_smoke_size(script, smoke_runs):
    proc = smoke_runs[script].result()
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert SMOKE[script][1] in output, output[-4000:]
    check_figures(script, proc.stdout)


@pytest.mark.vllm
@pytest.mark.slow
def test_recipe_study_at_smoke_size_killed_in_each_kind_of_pilot_stage_goes_on(ray_local, tmp_path):
    """recipe_study.py's smoke (OWN_TEST), as a user runs it: the pilot on SmolLM2, SIGKILLed
    (the command's whole process group) while a recipe's generate job runs, while its trainer
    runs (a checkpoint written) and while the acceptance job runs (a pass kept); the same
    command each time goes on from the last finished stage, and the last prints the study.
    Each stage finished once (pilot.json: two runs for the killed ones, one for the others),
    the greedy draft trained each step once, and the study's figures are checked as the
    lanes' smokes are."""
    if prompt_sets_missing():
        pytest.skip(prompt_sets_missing())
    root = tmp_path / "pilot"
    greedy = root / "recipes" / "greedy"

    def start() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "recipe_study.py"), "--smoke", "--work",
                                 str(root)], cwd=REPO, env={**attached(ray_local), "PYTHONPATH": str(REPO)},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, process_group=0)

    def running(stage: str) -> bool:
        try:
            return json.loads((root / "pilot.json").read_text()).get("running", {}).get("stage") == stage
        except (OSError, ValueError):
            return False

    def kill_when(ready) -> None:
        study, deadline = start(), time.monotonic() + 1200
        while not ready():
            assert study.poll() is None, f"ended before the kill point ({study.returncode}):\n{study.stdout.read()[-4000:]}"
            assert time.monotonic() < deadline, "the kill point was not reached"
            time.sleep(0.2)
        os.killpg(study.pid, signal.SIGKILL)
        study.wait()
        study.stdout.close()

    kill_when(lambda: running("generate:greedy") and (greedy / "out" / "manifest.json").exists())
    kill_when(lambda: running("train:greedy") and (greedy / "draft" / "step-2").is_dir())
    kill_when(lambda: running("acceptance") and any((root / "acceptance").glob("passes/*.json")))
    last = start()
    output, _ = last.communicate(timeout=1800)
    assert last.returncode == 0, output[-6000:]
    stages = json.loads((root / "pilot.json").read_text())["stages"]
    assert {name: len(s["runs"]) for name, s in stages.items()} == {
        "generate:dataset": 1, "train:dataset": 1, "generate:greedy": 2, "train:greedy": 2, "acceptance": 2}
    assert all(s["done"] for s in stages.values())
    assert "pilot: generate:dataset finished earlier" in output
    steps = [r["step"] for r in map(json.loads, (greedy / "draft" / "metrics.jsonl").read_text().splitlines())
             if "step" in r]
    assert steps == [1, 2, 3, 4]  # each once across the two runs (--smoke logs every step)
    assert "holds a run of these settings that did not finish (checkpoints: step-2): it resumes from its latest " \
           "checkpoint" in (greedy / "train.log").read_text()
    # The acceptance job killed with a pass kept: its rerun reuses that pass (its log, both runs appended).
    assert "acceptance: the target alone: reusing the pass finished at" in (root / "acceptance.log").read_text()
    report = json.loads((root / "report.json").read_text())
    assert [p["step"] for p in report["tau"]["0"]["by_step"]["greedy"]] == [2, 4]
    assert (root / "report.png").stat().st_size > 1000
    check_figures("recipe_study.py", output)


def check_figures(script: str, output: str) -> None:
    """The script's figures read back by its checker; a failure shows the end of its output."""
    try:
        FIGURES[script](output)
    except AssertionError as e:
        raise AssertionError(f"{script}'s figures: {e}\n--- its output ---\n{output[-4000:]}") from None


# --- reading the figures back -------------------------------------------------------------

def json_lines(output: str, prefix: str = "") -> list[dict]:
    """Every line of `output` that is `prefix` and a JSON object, parsed."""
    return [json.loads(line[len(prefix):]) for line in output.splitlines() if line.startswith(prefix + "{")]


def result(output: str) -> dict:
    """The script's one `RESULT {...}` line."""
    [found] = json_lines(output, "RESULT ")
    return found


def tables(output: str) -> list[list[dict[str, str]]]:
    """Every markdown table printed: its rows, each {header: cell}."""
    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip().strip("|").split("|")]

    lines, found = output.splitlines(), []
    for i, line in enumerate(lines[:-1]):
        if line.startswith("| ") and lines[i + 1].startswith("|---"):
            header, rows = cells(line), []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                assert len(cells(row)) == len(header), (header, row)
                rows.append(dict(zip(header, cells(row))))
            found.append(rows)
    return found


FIGURE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")


def numbers(cell: str) -> list[float]:
    """The figures in a table cell: "1,234", "12.5%", "**0.53**", "3 of 4", "150 MiB", "0.0e+00"."""
    found = [float(f.replace(",", "")) for f in FIGURE.findall(cell)]
    assert found, f"no figure in {cell!r}"
    return found


def number(cell: str) -> float:
    return numbers(cell)[0]


def sane(*values: float, zero: bool = False) -> None:
    """Finite and positive (or zero, where a smoke-size figure may round to it)."""
    for v in values:
        assert isinstance(v, (int, float)) and not isinstance(v, bool), v
        assert math.isfinite(v) and (v >= 0 if zero else v > 0), v


def cpu_seconds(*values: float) -> None:
    """CPU seconds inside a window: differences of sampled counters, the sampler's own thread
    (timed to the nanosecond) taken out of its process's (counted in 10 ms ticks), so a figure
    near 0 may dip a little below it."""
    for v in values:
        assert math.isfinite(v) and v >= -0.05, v


def share(*values: float) -> None:
    for v in values:
        assert math.isfinite(v) and 0 <= v <= 1, v


# --- each script's figures (at its smoke size, tests/smokes.py) -----------------------------

def recipe_study(output: str) -> None:
    """The pilot ran every stage on SmolLM2 (two recipes, greedy's half-way checkpoint, two
    temperatures): each recipe's tau in range with its interval around it, at both; the paired
    difference finite; every greedy output with a draft the target's own."""
    r = result(output)
    assert r["sizes"] == {"prompts": 6, "small": 0, "large": 0, "steps": 4, "batch": 2, "max_tokens": 12, "test": 3,
                          "mt_bench": 2, "draft_vocab": 512, "k": 3, "seed": 0}
    assert set(r["stage_seconds"]) == {"generate:dataset", "train:dataset", "generate:greedy", "train:greedy",
                                       "acceptance"}
    sane(*r["stage_seconds"].values())
    assert set(r["tau"]) == {"0", "0.7"}
    for taus in r["tau"].values():
        assert set(taus) == {"dataset", "greedy"}
        for tau, lo, hi in taus.values():  # k = 3: at most 4 tokens a step
            assert 1 <= lo <= tau <= hi <= 4
    for differences in r["differences"].values():
        assert set(differences) == {"greedy - dataset"}
        difference, lo, hi = differences["greedy - dataset"]
        assert lo <= difference <= hi
    assert r["lossless"] == {"dataset": {"equal": 5, "of": 5, "mismatches": []},
                             "greedy": {"equal": 5, "of": 5, "mismatches": []}}
    assert r["pilot_overhead"]["seconds"] >= r["pilot_overhead"]["stages_seconds"] > 0


def driver_memory(output: str) -> None:
    runs = json_lines(output)
    assert [(r["rows"], r["sample"], list(r["wall_s"])) for r in runs] == [
        (200, None, ["prompts", "generate"]), (400, None, ["prompts", "generate"]), (400, 100, ["prompts"])]
    for r in runs:
        # Every synthetic row is a prompt (or the sample's), and each is answered.
        assert r["prompts"] == (r["sample"] or r["rows"]) and r["ok"] == (None if r["sample"] else r["rows"])
        assert list(r["phases_mib"]) == list(r["wall_s"])
        sane(*r["wall_s"].values(), r["driver_cpu_s"], r["worker_cpu_s"], r["driver_peak_rss_mib"], r["workers"],
             r["worker_peak_max_mib"], r["worker_peak_anon_max_mib"])
        for peaks in r["phases_mib"].values():
            sane(peaks["VmRSS"], peaks["RssAnon"])
            sane(peaks["RssShmem"], zero=True)  # the object store's pages: next to nothing at this size
    [table] = tables(output)
    assert [(row["rows"], row["source.sample"]) for row in table] == [("200", "null"), ("400", "null"), ("400", "100")]


def engine_feeding(output: str) -> None:
    runs = json_lines(output)
    assert [r["setting"] for r in runs] == ["4 x 4", "naive (all rows x 1)"]
    for r in runs:
        assert r["rows"] == r["ok"] == 40  # the rows the engine admitted, and the rows published
        sane(r["rows_per_s"], r["wall_s"], r["window_s"], r["avg_in_flight"], r["calls"])
        sane(r["ramp_s"], r["first_return_s"], zero=True)
        share(r["util"])
        assert r["util"] > 0
    [table] = tables(output)
    assert [row["B x C"] for row in table] == [r["setting"] for r in runs]


def hidden_states_throughput(output: str) -> None:
    paths, cpu = tables(output)
    assert len(paths) == 7  # bare vLLM x 3, the phase x 3, the floor
    for row in paths:
        assert number(row["rows"]) == 8  # the script asserts every row's states were made and published
        sane(number(row["tokens"]), number(row["seconds"]))
        # Rounded: a slow run's rate, the wall's ratio and a quick load can print 0.
        sane(number(row["prefill tok/s"]), number(row["vs bare vLLM"]), number(row["load s"]), zero=True)
    assert len({row["tokens"] for row in paths}) == 1
    assert [row["CPU s inside the window"] for row in cpu][-2:] == ["all processes",
                                                                   "all but vLLM's two processes, per row (ms)"]
    for row in cpu:
        label, *cells = row.values()
        for cell in (c for c in cells if c != "-"):
            seconds, *rest = numbers(cell)
            cpu_seconds(seconds)
            if label.startswith("all but"):  # "s (ms per row)": the same figure twice
                [per_row_ms] = rest
                assert per_row_ms == pytest.approx(1000 * seconds / 8, abs=1000 * 0.005 / 8 + 0.05), cell
            else:
                sane(*rest)  # the window's cores and capacity
    written = re.search(r"written/estimate (\S+)", output)
    assert written and 0.9 < float(written.group(1)) < 1.5, written  # the estimate is near what was written




def postprocess_throughput(output: str) -> None:
    r = result(output)
    assert r["rows"] == 40 and r["kept_every_token"] is True and r["generated_tokens"] > 0
    methods = {"ours (Postprocessor)", "floor (a): batch_decode only", "floor (a'): Rust decode_batch only"}
    assert set(r["cpu_s"]) == set(r["wall_s"]) == methods
    sane(*r["cpu_s"].values(), *r["wall_s"].values())
    [table] = tables(output)
    assert {row["method"] for row in table} == methods




def reader_memory(output: str) -> None:
    [r] = json_lines(output)
    assert r["rows"] == r["samples"] == 400 and r["shards"] == 4
    sane(r["tokens"], r["rss_before_mib"], r["rss_after_index_mib"], r["rss_peak_sampled_mib"], r["ru_maxrss_mib"],
         *r["rss_during_mib"].values())
    # Rounded: 0.0 at 400 rows; a slow run's rate can print 0.
    sane(r["index_s"], r["iterate_s"], r["data_on_disk_mib"], r["samples_per_s"], zero=True)
    [[row]] = tables(output)
    assert number(row["rows"]) == 400 and number(row["shards"]) == 4




def server_vs_job(output: str) -> None:
    runs, breakdown = tables(output)
    assert [row["run"] for row in runs] == ["bare vLLM (LLM.generate)", "job, default feeding", "server C=2"]
    for row in runs:
        ok, lost = number(row["rows ok"]), sum(numbers(row["rows lost"]))  # lost: "0", or "1 timeout, 1 error"
        assert ok + lost == 6
        exact, asked = numbers(row["exact rows"])[:2]  # "ids 6/6 ..." against bare vLLM's
        assert asked == ok and 0 <= exact <= asked
        # Rounded (a slow run's tokens/s can print 0), and a server that lost every row made none.
        sane(number(row["seconds"]), number(row["generated tokens"]), number(row["tokens/s"]), number(row["load s"]),
             number(row[next(k for k in row if k.startswith("vs "))]), zero=True)
    bare, job, server = runs
    # The same seeds on the same engine: the job stores bare vLLM's tokens, on every row.
    assert number(bare["rows ok"]) == number(job["rows ok"]) == 6 and job["exact rows"] == "ids 6/6"
    assert job["generated tokens"] == bare["generated tokens"]
    assert "prompt ids differ" not in server["exact rows"]  # the server rendered the job's prompt ids
    for row in breakdown:
        for cell in list(row.values())[1:]:
            if cell != "-":
                cpu_seconds(*numbers(cell))




def stream_scale(output: str) -> None:
    steps, memory = tables(output)
    [row] = steps  # --smoke: --steps 2
    assert number(row["trainer step (x engine)"]) == 2 and number(row["rows"]) == 48
    sane(number(row["wall s"]), number(row["engine ms a row (median batch)"]))
    share(number(row["trainer waits (share of its time)"]) / 100,
          number(row["engine idles (share of its window)"]) / 100,
          *(x / 100 for x in numbers(row["the stream's own: engines busy, trainers waited"])))
    assert [number(row["rows"]) for row in memory] == [4, 48]
    for row in memory:  # MiB; nothing is spilled
        assert number(row["spilled to disk"]) == 0
        sane(number(row["bound (its limit)"]), number(row["driver peak RSS"]),
             number(row["training worker peak RSS (max)"]), number(row["worker's own (RssAnon)"]),
             number(row["worker's own between steps"]))
        in_flight, rows = numbers(row["peak in flight (the stream's count)"])
        assert 0 < in_flight <= number(row["bound (its limit)"]) and 0 < rows <= number(row["rows"])
        # Sampled every 0.5 s: a quick run (4 rows on a fast machine) can end between two samples.
        sane(number(row["object store peak"]), number(row["split coordinator peak RSS"]), zero=True)
        sane(number(row["worker's shared (RssShmem)"]), number(row["chunks held >= 1 s (no room)"]), zero=True)
    r = result(output)
    assert r["runs"]["2.0"]["rows"] == 48 and r["baseline"]["rows"] == 4
    assert r["runs"]["2.0"]["spilled"] == r["baseline"]["spilled"] == 0
    # The bound held, at any speed: the smoke's limit (tests/smokes.py: --max-bytes) is above the
    # gate's floor (2 workers' windows and the split, 20 rows of at most 96 tokens: <= 110 MB), so
    # the bound is the limit itself, never raised; the gate admits a chunk only within it, so the
    # peak in flight is within the limit, and the 48 rows (~180 MB) were never all in flight at
    # once. How close the peak comes to the limit depends on how far the engine runs ahead of
    # the trainer, which a loaded machine changes: the full run measures it.
    args = SMOKE["stream_scale.py"][0]
    limit = int(args[args.index("--max-bytes") + 1])
    large, baseline = r["runs"]["2.0"]["stream"], r["baseline"]["stream"]
    assert large["limit_bytes"] == large["bound_bytes"] == baseline["bound_bytes"] == limit, (large, baseline)
    assert large["peak_bytes_in_flight"] <= limit and large["peak_rows_in_flight"] < 48, large
    assert baseline["peak_bytes_in_flight"] <= limit and baseline["peak_rows_in_flight"] <= 4, baseline
    ratios = re.search(r"object store peak x(\S+), peak in flight x(\S+), driver x(\S+)", output)
    assert ratios, "no ratios line"
    sane(*(float(x.rstrip(",")) for x in ratios.groups()), zero=True)




FIGURES = {f.__name__ + ".py": f for f in (
    driver_memory, engine_feeding, hidden_states_throughput, postprocess_throughput,
    reader_memory, recipe_study, server_vs_job, stream_scale)}
