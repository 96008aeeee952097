# The two commands a newcomer types: `make demo` and `make test` (each sets up first if needed).
# PROFILE=tf218 selects the TF 2.18 + tf-keras profile (.venv-tf218); PROFILE=modern current
# TensorFlow with Keras 3 and numpy 2, no horovod (.venv-modern, backend="tf"); PROFILE=torch
# PyTorch on Spark 4, no TensorFlow, no horovod (.venv-torch, backend="torch"). See README.
PROFILE ?= tf215
DEMO_ARGS :=
# Spark Connect's tests need pyspark[connect] and Spark 4: the modern profile runs them; the
# torch backend's, the torch profile.
# The tf backend runs in the modern profile (Keras 3, what backend="tf" users start with); here
# on TF 2.15 + Keras 2 only its tests marked keras2 (those that could differ with Keras 2): the
# rest is the same code in both, and CI time is spent once.
# A Keras relaunch from the host copy runs here once (Keras 2's .h5 files on Horovod): moving
# rank 0 and async_save add nothing of Keras 2's own (the modern profile runs both end to end;
# this profile's unit tests run Keras 2's async saves and Horovod's copy transport).
TEST_ARGS := -m "not connect and not torch_backend and (keras2 or not tf_backend)" \
	--deselect "tests/integration/test_demo.py::test_demo_trains_saves_and_reloads[tf]" \
	--deselect "tests/integration/test_checkpoint_faults.py::test_a_keras_relaunch_restores_rank_0s_host_copy[rank-0-moved]" \
	--deselect "tests/integration/test_checkpoint_faults.py::test_a_keras_relaunch_restores_rank_0s_host_copy[same-host-async]"
ifeq ($(PROFILE),tf218)
PY := .venv-tf218/bin/python
export TF_USE_LEGACY_KERAS := 1
else ifeq ($(PROFILE),modern)
PY := .venv-modern/bin/python
DEMO_ARGS := --backend tf
# Spark 4 + Keras 3 + MLflow 3: the tests that start nothing, every test of the tf backend,
# those marked every_profile (DataFrame data path, scoring, MLflow) and Spark Connect's; never
# horovod.
# A standalone cluster is reached here through a Spark Connect server (test_connect).
TEST_ARGS := -m "(tf_backend or every_profile or connect or not (spark or ranks or cluster or netns or notebook)) and not horovod and not torch_backend"
else ifeq ($(PROFILE),torch)
PY := .venv-torch/bin/python
DEMO_ARGS := --backend torch
# PyTorch on Spark 4 (classic and Connect), no TensorFlow: the torch backend's tests -- local,
# Spark, side by side with TorchDistributor, failure matrix, multi-host -- and its unit tests.
TORCH_TESTS := tests/unit/test_rank_placement.py tests/integration/test_torch.py tests/integration/test_demo.py \
	tests/integration/test_torch_ecosystem.py tests/unit/test_torch_numbering.py \
	tests/integration/test_checkpoint_faults.py tests/integration/test_docs_examples.py \
	tests/integration/test_failures.py tests/cluster/test_multihost_torch.py tests/unit/test_data_order.py \
	tests/integration/test_elastic.py tests/integration/test_time_split.py tests/unit/test_timing.py \
	tests/unit/test_collective_waits.py tests/unit/test_device_batches.py tests/unit/test_async_checkpoints.py \
	tests/unit/test_host_copy.py
TEST_ARGS := -m "torch_backend or not (spark or ranks or azurite or cluster or netns or notebook or connect or horovod)" $(TORCH_TESTS)
else
PY := .venv/bin/python
endif

.PHONY: setup demo test unit lint docs test-keras bench clean cluster-up cluster-down

setup:
	@PROFILE=$(PROFILE) bash scripts/setup.sh

demo: setup
	$(PY) scripts/demo.py $(DEMO_ARGS)

test: setup
	$(PY) -m pytest $(TEST_ARGS)

# tests/unit: start nothing (no Spark, rank process, server or cluster; conftest enforces it).
unit: setup
	$(PY) -m pytest tests/unit

# ruff (pyflakes, import order, bugbear) and mypy (strict on common/ and the wire types), both
# configured in pyproject.toml; .ci/run runs this first.
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
ifeq ($(PROFILE),torch)
	@# B12 runs Ray Train v2 on Spark beside sparkhvd, from an environment of its own
	@test -x .venv-ray/bin/python || { python3 -m venv .venv-ray && .venv-ray/bin/python -m pip \
		install -q --disable-pip-version-check -c constraints-torch.txt \
		"ray[default,train]==2.60.0" torch==2.13.0 pyspark==4.3.0 psutil; }
endif
	$(PY) bench/bench.py $(foreach c,$(CASE),--case $(c))

# The multi-host test cluster (network namespaces, root only), by hand for debugging.
cluster-up: setup
	$(PY) scripts/cluster.py up

cluster-down:
	$(PY) scripts/cluster.py down

clean:
	rm -rf runs .pytest_cache spark-warehouse site
