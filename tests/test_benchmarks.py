"""No benchmark can rot: each script in benchmarks/ runs at a smoke size (seconds, a real
model load for the vLLM ones) and must exit 0 and print its figures. The full sizes stay
manual (each script's docstring). The runs start with the session (tests/smokes.py)."""

from __future__ import annotations

import pytest

from smokes import MARKS, SMOKE
from support import REPO


def test_every_benchmark_has_a_smoke_size():
    scripts = {p.name for p in (REPO / "benchmarks").glob("*.py") if not p.name.startswith("_")}
    assert scripts == set(SMOKE)


@pytest.mark.parametrize("script", [pytest.param(s, marks=MARKS.get(s, ())) for s in sorted(SMOKE)],
                         ids=lambda s: s.removesuffix(".py"))
def test_benchmark_runs_at_smoke_size(script, smoke_runs):
    proc = smoke_runs[script].result()
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert SMOKE[script][1] in output, output[-4000:]
