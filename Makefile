# The two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo run migrate test lint typecheck unit integration e2e bench soak clean browser pgbouncer

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,bench,embedded,api,otel]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/fluxora-webhooks demo --serve

run: $(STAMP)
	$(BIN)/fluxora-webhooks run

migrate: $(STAMP)
	$(BIN)/fluxora-webhooks migrate

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# The dashboard's browser tests drive Debian's Chromium (a browser download is neither
# possible nor needed); installed when missing, as root.
browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# The tests behind a connection pooler start Debian's PgBouncer of their own.
pgbouncer:
	@command -v pgbouncer >/dev/null 2>&1 || test -x /usr/sbin/pgbouncer || { \
	  apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pgbouncer >/dev/null; }

test: lint typecheck browser pgbouncer
	$(BIN)/pytest -n 2 --dist loadfile

unit: $(STAMP)
	$(BIN)/pytest tests/unit

integration: $(STAMP)
	$(BIN)/pytest tests/integration

e2e: $(STAMP)
	$(BIN)/pytest tests/e2e

bench: $(STAMP)
	$(BIN)/fluxora-webhooks bench

soak: $(STAMP)
	$(BIN)/python scripts/soak.py --minutes 10

clean:
	rm -rf $(VENV) .fluxora .fluxora-test .pytest_cache .mypy_cache .ruff_cache
