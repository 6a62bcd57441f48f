# Two entry points (README): `make demo` and `make test`. Each creates its virtualenv on first use
# and reuses it while the pinned requirements are unchanged.
PYTHON ?= python3
VENV ?= .venv
BRIDGE_VERSION ?= 0.3.1
REQ := requirements/py311-core0161.txt
# What Bridge's own pretrain() imports beyond REQ (tests/bridge_real/ runs it in the main tier).
REAL_REQ := requirements/bridge-real-py3.11.txt
STAMP := $(VENV)/.installed-$(shell cat $(REQ) $(REAL_REQ) Makefile pyproject.toml | sha1sum | cut -c1-12)
PY := $(VENV)/bin/python

.PHONY: demo test test-fast test-main matrix nemo lint clean

# flock: the matrix and NeMo installs, which .ci/test-all.sh runs alongside, build the same egg-info.
$(STAMP): $(REQ) $(REAL_REQ) pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r $(REQ) -r $(REAL_REQ)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps megatron-bridge==$(BRIDGE_VERSION)
	flock .venv-editable.lock $(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	@rm -f $(VENV)/.installed-* && touch $@

demo: $(STAMP)
	NO_VCS_VERSION=1 $(VENV)/bin/mxfp8-plugin demo

# The README's test command: lint (ruff, mypy), the full suite on core 0.16.1 (Python 3.11; Bridge
# 0.3.1's real pretrain() included), the release matrix (core 0.14.0, 0.15.3 on 3.11; 0.17.1, 0.18.2,
# 0.19.2 on 3.12 with their Bridge releases' real pretrain()), then NeMo 2's real Lightning stack.
test:
	bash .ci/test-all.sh

# The fast tier: tests/unit, every single-process test (no spawned ranks: the engine's state machine
# against fakes of megatron-core, every config rule, the config column, the CLI, packaging): about
# a minute (docs/testing.md has the tier times).
# Reuses an existing venv as it is (a stale stamp would reinstall); creates one only if missing.
test-fast:
	@test -x $(PY) || $(MAKE) --no-print-directory $(STAMP)
	NO_VCS_VERSION=1 $(PY) -m pytest -q -p no:cacheprovider tests/unit

# Every tier this venv can run: unit, ranks, bridge_real (tests/nemo runs in .venv-nemo, tests/gpu on
# a 2-GPU host). The doctor's report heads the log: which torch / megatron-core / bridge it ran against.
# Then the release-order and verifier tests again with the kit's TE-shaped MXFP8 param
# (MXFP8_PARAM_KIND=te), so the Transformer Engine branches of core and of the plugin run too,
# the verifier's fused kernel in Triton's interpreter (MXFP8_EXPECT_FUSED: it must be used); .ci/matrix.sh
# does the same in core0192 with the kernel off (MXFP8_VERIFY_FUSED=0: the type's own write path).
# tests/unit too when run alone; `make test` runs it once, as the fast tier (MAIN_TIERS="tests/ranks tests/bridge_real").
MAIN_TIERS ?= tests/unit tests/ranks tests/bridge_real
test-main: $(STAMP)
	NO_VCS_VERSION=1 $(VENV)/bin/mxfp8-plugin doctor
	MXFP8_REAL_BRIDGE=require NO_VCS_VERSION=1 $(PY) -m pytest -q -p no:cacheprovider -rs --durations=15 \
		$(MAIN_TIERS)
	MXFP8_PARAM_KIND=te MXFP8_EXPECT_FUSED=1 NO_VCS_VERSION=1 $(PY) -m pytest -q -p no:cacheprovider -m matrix \
		tests/ranks/test_matrix.py tests/ranks/test_weights.py tests/ranks/test_sampling.py \
		tests/ranks/test_replica.py tests/ranks/test_ensure.py

matrix:
	bash .ci/matrix.sh core0140 core0153 core0171 core0182 core0192

matrix-%:
	bash .ci/matrix.sh $*

nemo:
	bash .ci/nemo.sh

lint: $(STAMP)
	bash .ci/lint.sh

clean:
	rm -rf $(VENV) .venv-* .matrix build dist *.egg-info
