# The two commands a newcomer types: `make demo` and `make test` (each sets up first if needed).
# PROFILE=tf218 selects the TF 2.18 + tf-keras profile (.venv-tf218); PROFILE=modern current
# TensorFlow with Keras 3 and numpy 2, no horovod (.venv-modern, backend="tf"). See README.
PROFILE ?= tf215
DEMO_ARGS :=
# Spark Connect's tests need pyspark[connect] and Spark 4: the modern profile runs them.
TEST_ARGS := -m "not connect"
ifeq ($(PROFILE),tf218)
PY := .venv-tf218/bin/python
export TF_USE_LEGACY_KERAS := 1
else ifeq ($(PROFILE),modern)
PY := .venv-modern/bin/python
DEMO_ARGS := --backend tf
# Spark 4 + Keras 3 + MLflow 3: the tests that start nothing, every test of the tf backend,
# those marked every_profile (DataFrame data path, scoring, MLflow) and Spark Connect's; never
# horovod.
TEST_ARGS := -m "(tf_backend or every_profile or connect or not (spark or ranks or cluster or netns or notebook)) and not horovod"
else
PY := .venv/bin/python
endif

.PHONY: setup demo test unit test-keras bench clean cluster-up cluster-down

setup:
	@PROFILE=$(PROFILE) bash scripts/setup.sh

demo: setup
	$(PY) scripts/demo.py $(DEMO_ARGS)

test: setup
	$(PY) -m pytest $(TEST_ARGS)

# tests/unit: start nothing (no Spark, rank process, server or cluster; conftest enforces it).
unit: setup
	$(PY) -m pytest tests/unit

# The Keras tests (unit + 2-rank integration), e.g. `make test-keras PROFILE=tf218`.
test-keras: setup
	$(PY) -m pytest tests/unit/test_keras_unit.py tests/integration/test_keras.py tests/unit/test_env_compat.py

# Benchmarks (never part of `make test`): `make bench` or `make bench CASE=B1`.
CASE ?=
bench: setup
	$(PY) bench/bench.py $(foreach c,$(CASE),--case $(c))

# The multi-host test cluster (network namespaces, root only), by hand for debugging.
cluster-up: setup
	$(PY) scripts/cluster.py up

cluster-down:
	$(PY) scripts/cluster.py down

clean:
	rm -rf runs .pytest_cache spark-warehouse
