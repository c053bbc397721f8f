"""The package's shape: imports run one way between its layers, no modules import each other
round a cycle, and the "Output" section of docs/formats.md lists the columns
storage/contract.py defines."""

from __future__ import annotations

import ast
import re

import pytest

from support import REPO
from eagle_data.storage.contract import SCHEMAS, data_schema

# Lower number = lower layer; a module may import from its own layer or lower ones. A module
# is in the layer of the first prefix here that it starts with.
LAYERS = [
    ("eagle_data.errors", 0), ("eagle_data.config", 0), ("eagle_data.config_doc", 0), ("eagle_data.model_files", 0),
    ("eagle_data.feature_shape", 0), ("eagle_data.draft_files", 0),
    ("eagle_data.tiny_models", 0),  # the tests' and the benchmarks' models: imports nothing of the project
    ("eagle_data.storage", 1), ("eagle_data.reader", 2), ("eagle_data.tools", 3),
    ("eagle_data.job.ray_internals", 4), ("eagle_data.job.stages.columns", 4),  # what the stages build on
    ("eagle_data.job.stages.engines", 5),  # the engine stage: its backends and what they share
    ("eagle_data.job.phases.run", 8), ("eagle_data.job.phases", 7),
    ("eagle_data.training", 8),  # the stream and the draft trainer: they run the phase's engine stage
    ("eagle_data.evaluation", 8),  # the acceptance job: the generate phase's engine stage with a draft
    ("eagle_data.job", 6),  # the other stages and what phases and stages share
    ("eagle_data.__main__", 9), ("ray_jobs", 9),
]


def layer(module: str) -> int | None:
    for prefix, number in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return number
    return None


def imports(path, every: bool = False) -> set[str]:
    """The project's modules (and names) a file imports; with `every`, all top-level imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)  # `from eagle_data.storage import manifest`
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names if every else {n for n in names if n.startswith(("eagle_data", "ray_jobs"))}


def module_name(path) -> str:
    name = ".".join(path.relative_to(REPO).with_suffix("").parts)
    return name.removesuffix(".__init__")


def test_no_module_imports_from_a_higher_layer():
    upward = []
    files = [*(REPO / "eagle_data").rglob("*.py"), *(REPO / "ray_jobs").rglob("*.py")]
    for path in files:
        here = module_name(path)
        assert layer(here) is not None or here == "eagle_data", f"{here} belongs to no layer"
        for name in imports(path):
            there = layer(name)
            if there is not None and layer(here) is not None and there > layer(here):
                upward.append(f"{here} imports {name}")
    assert upward == []


def import_graph() -> dict[str, set[str]]:
    """{module: the project's modules it imports}, from every import in eagle_data/ and ray_jobs/
    (function-level ones too); `from a.b import c` is module a.b.c where that is one, else a.b."""
    paths = {module_name(p): p for p in [*(REPO / "eagle_data").rglob("*.py"), *(REPO / "ray_jobs").rglob("*.py")]}
    graph = {}
    for here, path in paths.items():
        graph[here] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    graph[here].add(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in paths else node.module)
            elif isinstance(node, ast.Import):
                graph[here].update(a.name for a in node.names)
        graph[here] &= paths.keys()
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, found = {}, {}, [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    """A module imports only modules that do not import it back, directly or round a cycle."""
    found = cycles(import_graph())
    assert found == [], "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_formats_output_section_matches_the_contract():
    formats = (REPO / "docs" / "formats.md").read_text()
    block = formats.split("## Output", 1)[1].split("```")[1]
    listed, folder = {}, None
    for line in block.splitlines():
        start = re.match(r"^(\w+)/\*\.parquet\s+(.*)$", line)
        if start:
            folder, line = start.groups()
            listed[folder] = ""
        elif not line.startswith(" "):
            folder = None
        if folder:
            listed[folder] += " " + line.strip()
    assert set(listed) == set(SCHEMAS)
    for folder, schema in SCHEMAS.items():
        columns = re.sub(r"\([^)]*\)", "", listed[folder])  # (int32), (stop | length), (turns: all)
        assert [c.strip() for c in columns.split(",")] == schema.names, folder
    # data/'s optional columns (data_schema(k > 0)) are named in its entry too.
    assert [c for c in data_schema(1).names if c not in listed["data"]] == []


def test_storage_knows_no_config():
    """The OUT contract takes plain values: the job decides what its settings mean."""
    for path in (REPO / "eagle_data" / "storage").rglob("*.py"):
        banned = {n for n in imports(path, every=True)
                  if n.startswith(("eagle_data.config", "eagle_data.job", "eagle_data.tools", "pydantic", "yaml"))}
        assert banned == set(), path


@pytest.mark.parametrize("module", ["eagle_data.reader", "eagle_data.reader.batches"])
def test_what_a_training_script_imports_loads_no_config_pydantic_yaml_or_ray(module):
    """What a training script loads with `import eagle_data.reader` (or the stream's batches,
    `eagle_data.reader.batches`): the OUT contract and pyarrow."""
    import subprocess
    import sys

    code = (f"import sys, {module}; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pydantic', 'yaml', 'ray') "
            "or m.startswith(('eagle_data.config', 'eagle_data.job', 'eagle_data.tools'))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_stages_are_built_from_plain_values_and_import_no_phase():
    """A stage is one map_batches step: it does not orchestrate, so it imports no phase."""
    for path in (REPO / "eagle_data" / "job" / "stages").rglob("*.py"):
        assert not {n for n in imports(path) if n.startswith("eagle_data.job.phases")}, path
