# The README's two commands. Both bootstrap .venv on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench-data bench-models clean-venv

$(STAMP): requirements.txt requirements-nodeps.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q -r requirements.txt
	$(VENV)/bin/pip install -q --no-deps -r requirements-nodeps.txt
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m pretrain.demo

test: $(STAMP)
	$(PY) -m pytest -q tests

bench-data: $(STAMP)
	$(PY) -m bench.data

bench-models: $(STAMP)
	$(PY) -m bench.models

clean-venv:
	rm -rf $(VENV)
