# One entry point for newcomers: `make demo` and `make test` (see README.md).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PKGS := -e core -e probe-client -e server -e testbed

.PHONY: install demo test lint bench router clean

install: $(BIN)/.installed router

$(BIN)/.installed: core/pyproject.toml probe-client/pyproject.toml server/pyproject.toml testbed/pyproject.toml requirements-dev.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip==26.3
	$(BIN)/pip install --quiet -r requirements-dev.txt $(PKGS)
	touch $@

router:
	@if [ -f router-edge/Cargo.toml ]; then \
	  cargo build --quiet --release --manifest-path router-edge/Cargo.toml && \
	  for b in ka-router ka-linkem ka-blast; do \
	    if [ -f router-edge/target/release/$$b ]; then install -m 755 router-edge/target/release/$$b $(BIN)/$$b; fi; \
	  done; \
	fi

demo: install
	sudo -n true 2>/dev/null || [ "$$(id -u)" = 0 ] || { echo "ERROR: the demo builds network namespaces and needs root (run: sudo make demo)"; exit 1; }
	$(BIN)/kickass demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@if [ -f router-edge/Cargo.toml ]; then \
	  cargo fmt --all --manifest-path router-edge/Cargo.toml -- --check && \
	  cargo clippy --quiet --manifest-path router-edge/Cargo.toml --all-targets -- -D warnings; \
	fi

test: install lint
	@if [ -f router-edge/Cargo.toml ]; then cargo test --quiet --manifest-path router-edge/Cargo.toml; fi
	$(BIN)/pytest -q

bench: install
	$(BIN)/python bench/probe_bench.py > bench/probe_bench.json
	$(BIN)/python bench/router_bench.py > bench/router_bench.json
	@echo results in bench/probe_bench.json and bench/router_bench.json

clean:
	rm -rf $(VENV) router-edge/target
