# The two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo run migrate test lint typecheck unit integration e2e bench soak clean browser pgbouncer locales node promtool

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

# The test of a server that speaks German (tests/integration/test_translated_server.py,
# lc_messages) needs the de_DE.UTF-8 locale: generated when missing, as root.
locales:
	@locale -a 2>/dev/null | grep -qix 'de_DE.utf-\?8' || { \
	  test "$$(id -u)" = 0 || { echo "make locales: run it as root once (apt-get, locale-gen)" >&2; exit 1; }; \
	  { command -v locale-gen >/dev/null 2>&1 || { apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq locales >/dev/null; }; } && \
	  { grep -q '^de_DE.UTF-8 UTF-8' /etc/locale.gen 2>/dev/null || \
	    echo 'de_DE.UTF-8 UTF-8' >> /etc/locale.gen; } && \
	  locale-gen >/dev/null; }

# The Node.js consumer's test (tests/e2e/test_node_consumer.py) runs examples/node with the
# npm packages pinned in its package-lock.json: Debian's nodejs and npm, installed when
# missing (as root); the packages once per lock change (npm's cache serves a re-install).
NODE_MODULES := examples/node/node_modules/.installed

node: $(NODE_MODULES)

$(NODE_MODULES): examples/node/package.json examples/node/package-lock.json
	@command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 || { \
	  apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null; }
	cd examples/node && npm ci --prefer-offline --no-audit --no-fund --loglevel=error
	touch $@

# promtool checks and unit-tests docs/prometheus-alerts.yml (tests/alerts). Taken out of
# Debian's prometheus package into .tools/ rather than installed: installing the package
# would also set up a Prometheus server as a service.
PROMTOOL := .tools/promtool

promtool: $(PROMTOOL)

$(PROMTOOL):
	@rm -rf .tools/deb && mkdir -p .tools/deb
	cd .tools/deb && { apt-get download -qq prometheus 2>/dev/null || \
	  { apt-get update -qq && apt-get download -qq prometheus; }; } && \
	  dpkg-deb -x prometheus_*.deb root && cp root/usr/bin/promtool ../promtool
	@rm -rf .tools/deb
	$(PROMTOOL) --version | head -1

test: lint typecheck browser pgbouncer locales node promtool
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
	rm -rf $(VENV) .fluxora .fluxora-test .pytest_cache .mypy_cache .ruff_cache examples/node/node_modules
