# The two commands a newcomer types: `make demo` and `make test` (each sets up first if needed).
PY := .venv/bin/python

.PHONY: setup demo test unit clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) scripts/demo.py

test: setup
	$(PY) -m pytest

unit: setup
	$(PY) -m pytest -m "not spark"

clean:
	rm -rf runs .pytest_cache spark-warehouse
