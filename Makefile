# Two entry points (README): `make demo` and `make test`. Each creates its virtualenv on first use
# and reuses it while the pinned requirements are unchanged.
PYTHON ?= python3
VENV ?= .venv
BRIDGE_VERSION ?= 0.3.1
REQ := requirements/py311-core0161.txt
STAMP := $(VENV)/.installed-$(shell cat $(REQ) Makefile pyproject.toml | sha1sum | cut -c1-12)
PY := $(VENV)/bin/python

.PHONY: demo test lint clean

$(STAMP): $(REQ) pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r $(REQ)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps megatron-bridge==$(BRIDGE_VERSION)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	@rm -f $(VENV)/.installed-* && touch $@

demo: $(STAMP)
	NO_VCS_VERSION=1 $(VENV)/bin/mxfp8-plugin demo

test: $(STAMP)
	NO_VCS_VERSION=1 $(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m pip install -q ruff mypy types-PyYAML
	$(VENV)/bin/ruff check mbridge_mxfp8_plugin tests
	$(VENV)/bin/mypy mbridge_mxfp8_plugin

clean:
	rm -rf $(VENV) .venv-* build dist *.egg-info
