# eogp-index: `make demo` builds an index over the embedded default and queries it;
# `make test` runs the test suite. Both set up .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
FAISS  ?= cpu
INDEX  ?= default-index

.PHONY: install browser azurite demo test bench clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: on a CPU-only machine this is the CPU wheel; nothing may replace it.
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e ".[$(FAISS),test,eval,adapters,cluster]"
	# kronfluence declares torchvision, which would pull a CUDA torch; it never imports it.
	$(BIN)/pip install -q -c constraints.txt --no-deps kronfluence==1.0.1
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/eogp fit examples/default/model --data examples/default/corpus/train.jsonl.gz \
		--out $(INDEX) -k 256 --curvature-examples 256 --pca-examples 512 --max-tokens 128 --overwrite
	$(BIN)/eogp ingest $(INDEX) examples/default/corpus/train.jsonl.gz \
		--id-field id --metadata module --metadata kind --metadata qualname --metadata n_chars --store-text
	$(BIN)/eogp info $(INDEX)
	$(BIN)/eogp query $(INDEX) --queries examples/default/queries.jsonl --limit-queries 2 -k 5
	$(BIN)/eogp explain $(INDEX) --queries examples/default/queries.jsonl --top 1 --no-color

# The page's browser test drives Debian's headless Chromium (Playwright's own download cannot
# be reached from CI). Installed here when missing and we are root (CI is); otherwise the test
# skips, naming this command — and fails under CI=true.
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
		else \
			echo "no headless browser: the page's browser test will skip (install: sudo apt-get install chromium chromium-driver)"; \
		fi; \
	fi

# The az:// tests run on Azurite, Microsoft's Azure Storage emulator (npm), installed into
# .azurite/ when npm is there; without it those tests skip, naming this target.
azurite:
	@if [ ! -x .azurite/node_modules/.bin/azurite-blob ]; then \
		if command -v npm >/dev/null; then \
			npm install --silent --no-audit --no-fund --prefix .azurite azurite@3.37.0 \
				|| echo "azurite not installed: the az:// tests will skip"; \
		else \
			echo "no npm: the az:// tests will skip (install: sudo apt-get install npm; make azurite)"; \
		fi; \
	fi

# Two workers (pytest-xdist): the suite's processes are mostly single-threaded Python.
test: install browser azurite
	$(BIN)/python -m pytest -q -n 2

bench: install
	$(BIN)/python benchmarks/scan.py
	$(BIN)/python benchmarks/ingest_cost.py

clean:
	rm -rf $(VENV) $(INDEX)
