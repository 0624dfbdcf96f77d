# The README's two commands. Both bootstrap .venv on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# One JIT build directory per environment (pretrain/training/engine.py defaults to the same place).
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch_extensions

.PHONY: demo test bench-data bench-models clean-venv

$(STAMP): requirements.txt requirements-nodeps.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q -r requirements.txt
	$(VENV)/bin/pip install -q --no-deps -r requirements-nodeps.txt
	@# Build DeepSpeed's CPU shared-memory op now, not inside a run that may be killed mid-build.
	$(PY) -c "from deepspeed.accelerator import get_accelerator as a; \
	b = a().create_op_builder('ShareMemCommBuilder') if a().device_name() == 'cpu' else None; b and b.load()"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m pretrain.demo

# Two pytest-xdist workers, a test file (or a group of files, tests/conftest.py) at a time; what
# that saves is in docs/benchmarks.md, "The test suite's time".
test: $(STAMP)
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q -n 2 --dist loadgroup tests

bench-data: $(STAMP)
	$(PY) -m bench.data

bench-models: $(STAMP)
	$(PY) -m bench.models

clean-venv:
	rm -rf $(VENV)
