# The README's two commands. Both install what they need first (idempotent, seconds when already installed).
.PHONY: install train test bench

install:
	bash scripts/install.sh

train: install
	rayrl train

test: install
	ruff check --select F,E9 rayrl tests bench examples  # undefined names, unused imports, syntax
	python -m pytest -q -ra tests/unit
	python -m pytest -q -ra tests/integration tests/e2e tests/gpu

bench: install
	python bench/queue_vs_redis.py
