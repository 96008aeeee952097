# The two commands a newcomer types: `make demo` and `make test` (each sets up first if needed).
# PROFILE=tf218 selects the TF 2.18 + tf-keras profile (.venv-tf218); PROFILE=modern Spark 4 with
# current TensorFlow (Keras 3) and PyTorch side by side, numpy 2, no horovod (.venv-modern;
# backend="tf" and backend="torch"); PROFILE=torch is the same environment, with the demo on
# backend="torch". See README.
PROFILE ?= tf215
DEMO_ARGS :=
# A profile runs the tests where its stack adds coverage (CI runs the default and modern ones):
# - tests/unit (marked unit) once, in the modern profile, but for those marked every_profile,
#   keras2 or horovod: the stack changes their path (Keras 2 or 3, numpy 1 or 2, horovod).
# - Spark Connect's tests need pyspark[connect] and Spark 4, the torch backend's torch: the
#   modern profile runs them.
# - The tf backend runs in the modern profile (Keras 3, what backend="tf" users start with); here
#   on TF 2.15 + Keras 2 only its tests marked keras2 (those that could differ with Keras 2): the
#   rest is the same code in both, and CI time is spent once.
# - A Keras relaunch from the host copy runs here once (Keras 2's .h5 files on Horovod): moving
#   rank 0 and async_save add nothing of Keras 2's own (the modern profile runs both end to end;
#   this profile's unit tests run Keras 2's async saves and Horovod's copy transport).
TEST_ARGS := -m "not connect and not torch_backend and (keras2 or not tf_backend) and (not unit or every_profile or keras2 or horovod)" \
	--deselect "tests/integration/test_demo.py::test_demo_trains_saves_and_reloads[tf]" \
	--deselect "tests/integration/test_checkpoint_faults.py::test_a_keras_relaunch_restores_rank_0s_host_copy[rank-0-moved]" \
	--deselect "tests/integration/test_checkpoint_faults.py::test_a_keras_relaunch_restores_rank_0s_host_copy[same-host-async]"
ifeq ($(PROFILE),tf218)
PY := .venv-tf218/bin/python
export TF_USE_LEGACY_KERAS := 1
else ifneq ($(filter $(PROFILE),modern torch),)
PY := .venv-modern/bin/python
DEMO_ARGS := --backend $(if $(filter $(PROFILE),torch),torch,tf)
# Spark 4 + Keras 3 + PyTorch + MLflow 3: the tests that start nothing, every test of the tf and
# torch backends, those marked every_profile (DataFrame data path, scoring, MLflow) and Spark
# Connect's; never horovod. A standalone cluster is reached here through a Spark Connect server
# (test_connect).
TEST_ARGS := -m "(tf_backend or torch_backend or every_profile or connect or not (spark or ranks or cluster or netns or notebook)) and not horovod"
else
PY := .venv/bin/python
endif
# The tests mostly wait -- on JVMs, rank processes, notices, timeouts -- so two processes
# (pytest-xdist) fill this 2-core machine's idle time: each with its own SparkSession, servers,
# ports and temp folder (tests/conftest.py), the multi-host tests in one of them, first, on one
# cluster of network-namespace hosts (alone they take about 8 minutes). A third process beside
# that cluster made its tests miss their waits (a host's executor back within slot_wait_s, 6 of
# 33 failed). TEST_WORKERS=0 runs them in this one process.
TEST_WORKERS ?= 2
export SPARKHVD_TEST_PROFILE := $(PROFILE)

.PHONY: setup demo test test-ids unit lint docs test-keras bench bench-table clean cluster-up cluster-down

setup:
	@PROFILE=$(PROFILE) bash scripts/setup.sh

demo: setup
	$(PY) scripts/demo.py $(DEMO_ARGS)

test: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup $(TEST_ARGS)

# The ids `make test` runs in this profile, one a line (.ci/test-ids/ keeps a before and after).
test-ids:
	@$(MAKE) --no-print-directory setup PROFILE=$(PROFILE) >&2
	@$(PY) -m pytest --collect-only -q -p no:cacheprovider $(TEST_ARGS) | grep '::' | sort

# tests/unit: start nothing (no Spark, rank process, server or cluster; conftest enforces it).
unit: setup
	$(PY) -m pytest tests/unit

# ruff (pyflakes, import order, bugbear) and mypy (strict on common/ and the wire types), both
# configured in pyproject.toml; .ci/run runs it beside the default profile's tests.
LINT_PATHS := sparkhvd tests bench scripts jobs docs/examples notebooks
lint: setup
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m mypy

# The documentation site (mkdocs-material + mkdocstrings, mkdocs.yml) into site/, strict: a broken
# link, include or reference fails. Its code blocks are docs/examples/*.py, run by the tests.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# The Keras tests (unit + 2-rank integration), e.g. `make test-keras PROFILE=tf218`.
test-keras: setup
	$(PY) -m pytest tests/unit/test_keras_unit.py tests/integration/test_keras.py tests/unit/test_environment.py

# Benchmarks (never part of `make test`): `make bench` or `make bench CASE=B1`.
CASE ?=
# The default profile also gets torch (CPU, --no-deps: its setuptools>=77 would clash with the
# horovod build's pin) so that B2T, B3 and B11 measure every backend and petastorm in one run.
bench: setup
ifeq ($(PROFILE),tf215)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --disable-pip-version-check \
		--no-deps torch==2.13.0 sympy mpmath networkx filelock
endif
ifneq ($(filter $(PROFILE),modern torch),)
	@# B12 runs Ray Train v2 on Spark beside sparkhvd, from an environment of its own
	@test -x .venv-ray/bin/python || { python3 -m venv .venv-ray && .venv-ray/bin/python -m pip \
		install -q --disable-pip-version-check -c constraints-modern.txt \
		"ray[default,train]==2.60.0" torch==2.13.0 pyspark==4.3.0 psutil; }
endif
	$(PY) bench/bench.py $(foreach c,$(CASE),--case $(c))

# README's benchmark table, made from bench/RESULTS.md's goals (`make bench` does it too).
bench-table: setup
	$(PY) bench/bench.py --report

# The multi-host test cluster (network namespaces, root only), by hand for debugging.
cluster-up: setup
	$(PY) scripts/cluster.py up

cluster-down:
	$(PY) scripts/cluster.py down

clean:
	rm -rf runs .pytest_cache spark-warehouse site
