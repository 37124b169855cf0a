# The README's two commands. Both install what they need first (idempotent, seconds when already installed).
.PHONY: install train test bench

install:
	bash scripts/install.sh

train: install
	rayrl train

# Lint (rules in pyproject.toml), then the unit tests (seconds to minutes), then those that start Ray, vLLM, a
# `ray start` cluster or a GPU; chosen by marker (tests/conftest.py marks every other test `unit`).
test: install
	ruff check rayrl tests bench examples
	python -m pytest -q -ra -m unit
	python -m pytest -q -ra --durations=20 -m "integration or e2e or gpu or chaos"

bench: install
	python bench/queue_vs_redis.py
