# One entry point for newcomers: `make demo` and `make test` (see README.md).
# Every target goes through `system` first, so a fresh Debian machine needs nothing by hand.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PKGS := -e core -e db -e probe-client -e server -e atlas -e 'analysis[engines]' -e operations -e testbed -e wan-agents
PYPROJECTS := core/pyproject.toml db/pyproject.toml probe-client/pyproject.toml atlas/pyproject.toml \
	analysis/pyproject.toml operations/pyproject.toml \
	server/pyproject.toml testbed/pyproject.toml wan-agents/pyproject.toml requirements-dev.txt
RUST_BINS := ka-router ka-linkem ka-blast ka-agent-recv ka-send

.PHONY: system install demo test lint lint-python lint-rust rust-test bench router rust-build install-bins agent-deb clean

system:
	@tools/setup-system.sh

# The Python packages and the Rust build at once: pip mostly waits on files
# (pyspark is a 456 MB sdist), cargo on the CPU; CI has 40 minutes in all.
install: system
	@$(MAKE) --no-print-directory -j2 $(BIN)/.installed rust-build
	@$(MAKE) --no-print-directory install-bins zipapp

$(BIN)/.installed: $(PYPROJECTS)
	@echo "install: python packages into $(VENV)"
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/pip install --quiet --upgrade pip==26.3
	@$(BIN)/pip install --quiet -r requirements-dev.txt $(PKGS)
	@touch $@

rust-build:
	@echo "install: building the rust binaries ($(RUST_BINS))"
	@cargo build --quiet --release --workspace

# After a change to the Rust code: build and put the binaries beside the venv's.
router: $(BIN)/.installed rust-build
	@$(MAKE) --no-print-directory install-bins

install-bins:
	@for b in $(RUST_BINS); do install -m 755 target/release/$$b $(BIN)/$$b; done

# The remote receiver as one Debian package (the agent, its dependencies and
# ka-agent-recv prebuilt; wan-agents/deploy/build-deb.sh): build/agent/
# kickass-agent_<version>_amd64.deb and its .sha256. Reproducible: same sources,
# same bytes. Install on the receiver host: wan-agents/deploy/install-agent.sh DEB.
agent-deb: system $(BIN)/.installed
	@wan-agents/deploy/build-deb.sh build/agent

# The volunteer client in one file, for any Python 3.9+ (probe-client/README.md);
# the server serves it from here. Reproducible: same sources, same bytes.
ZIPAPP := $(VENV)/share/kickass/kickass-probe.pyz
ZIPAPP_SRC := $(wildcard core/kickass_core/*.py probe-client/kickass_probe/*.py) probe-client/build_zipapp.py
.PHONY: zipapp
zipapp: $(ZIPAPP)

$(ZIPAPP): $(ZIPAPP_SRC)
	@$(PY) probe-client/build_zipapp.py --output $@

demo: install
	@[ "$$(id -u)" = 0 ] || { echo "ERROR: the demo builds network namespaces and needs root (run: sudo make demo)"; exit 1; }
	$(BIN)/kickass demo

lint: install
	@$(MAKE) --no-print-directory -j2 --output-sync=target lint-python lint-rust

lint-python:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	@# pytest's second module named conftest: a mypy run has one of each name.
	$(BIN)/mypy tests/deploy/conftest.py

lint-rust:
	cargo fmt --all -- --check
	cargo clippy --quiet --workspace --all-targets -- -D warnings

rust-test: lint-rust
	cargo test --quiet --workspace

# The Python checks (mypy: one core) beside the Rust ones and the Rust tests'
# build (both cores), and all of it beside the two pytest streams
# (tools/run-tests.sh): CI has 40 minutes in all. Each part's output is kept
# together (--output-sync).
test: install
	BESIDE_TESTS="$(MAKE) --no-print-directory -j2 --output-sync=target lint-python rust-test" \
		tools/run-tests.sh $(BIN)/pytest

BENCHES := probe_bench router_bench atlas_bench trials_bench export_bench dashboards_bench schedule_bench

bench: install
	@for b in $(BENCHES); do echo "bench: $$b"; $(BIN)/python bench/$$b.py > bench/$$b.json || exit 1; done
	@echo results in $(foreach b,$(BENCHES),bench/$(b).json)

clean:
	rm -rf $(VENV) target
