# tokenmill: `make demo` runs the main job, `make test` the suite. Both set up .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The CPU build of torch lies on this machine's disk; install your own CUDA torch into .venv
# first and it is kept.
TORCH  ?= torch==2.13.0

.PHONY: setup model demo test test-e2e lint format clean promtool alertmanager chromium phoenix scenarios scenario-dumps corpus accuracy factorial blind-set generalization plan-validation plan-capacity plan-scale plan-upstream

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $@

model: $(STAMP)
	$(BIN)/tokenmill model fetch

demo: model
	$(BIN)/tokenmill generate --chat "What is the capital of France?" --max-tokens 32
	$(BIN)/tokenmill demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# tests/telemetry/test_metrics.py runs `promtool check metrics`; Debian's prometheus package has it.
promtool:
	@command -v promtool >/dev/null || { \
		SUDO=; if [ "$$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi; \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus \
		|| ($$SUDO apt-get update -qq \
			&& $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus); }

# tests/diagnose/test_alertmanager.py runs the exported findings alerts through a real Prometheus
# (Debian's `prometheus`, as above) and Alertmanager (`prometheus-alertmanager`, its binary too).
alertmanager: promtool
	@command -v prometheus-alertmanager >/dev/null || { \
		SUDO=; if [ "$$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi; \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus-alertmanager \
		|| ($$SUDO apt-get update -qq \
			&& $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus-alertmanager); }

# tests/dashboard/test_dashboard_browser.py drives headless Chromium through playwright; Debian's package.
chromium:
	@test -x /usr/bin/chromium || { \
		SUDO=; if [ "$$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi; \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium \
		|| ($$SUDO apt-get update -qq \
			&& $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium); }

# the suite without the whole-product tours and failure drills (marked e2e): CI's command
test: model lint promtool alertmanager chromium
	PYTHONSAFEPATH=1 $(BIN)/python -m pytest -m "not e2e"

# Arize Phoenix (a local trace UI on the GenAI conventions) in a venv of its own, for
# tests/telemetry/test_phoenix.py (about 860 MB: it never enters the project's venv)
PHOENIX_VENV ?= $(HOME)/.cache/tokenmill/phoenix-venv
phoenix:
	@test -x $(PHOENIX_VENV)/bin/phoenix || { $(PYTHON) -m venv $(PHOENIX_VENV) \
		&& $(PHOENIX_VENV)/bin/python -m pip install --quiet arize-phoenix; }

# the tours and drills alone (the demo, six-run comparisons, killed replicas, the wheels, a
# trace UI); their last run is in benchmarks/RESULTS.md
test-e2e: model promtool chromium phoenix
	PYTHONSAFEPATH=1 $(BIN)/python -m pytest -m e2e

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

# every symptom scenario on the real engine (minutes each); CI diagnoses the fast ones' recorded
# runs (scenario-dumps) and runs one live
scenarios: model
	@for s in $$($(BIN)/tokenmill scenario list | awk '{print $$1}'); do \
		$(BIN)/tokenmill scenario run $$s || status=1; done; exit $${status:-0}

# record the fast scenarios' real-engine runs as Parquet dumps (~9 minutes, alone on the
# machine; a recorded one is kept: delete its folder to record it again)
FAST_SCENARIOS := batching_ineffective client_server_ttft_gap host_bound_steps \
	itl_frontend_overhead kv_block_leak kv_pressure_long_answers oom_low_average_memory pd_decode_starved pd_ratio_imbalance \
	quantization_decode_heavy quantization_no_gain replica_imbalance spec_decode_ineffective ttft_prefill_bound
scenario-dumps: model
	PYTHONSAFEPATH=1 $(BIN)/python -m tokenmill.bench.corpus --out benchmarks/data/scenario_dumps \
		$(foreach s,$(FAST_SCENARIOS),--scenario $(s))

# the labelled diagnosis corpus (bench/corpus.py): every family's runs on the real engine, about
# a minute each, alone on the machine; resumable. Then the accuracy on its evaluation split.
CORPUS ?= benchmarks/data/diagnosis_corpus
corpus: model
	PYTHONSAFEPATH=1 $(BIN)/python -m tokenmill.bench.corpus --out $(CORPUS) --per-family 4
	# prefill interference, the family with the most variety: 10 runs, and 4 more tuning runs
	PYTHONSAFEPATH=1 $(BIN)/python -m tokenmill.bench.corpus --out $(CORPUS) --per-family 10 \
		--family itl_prefill_interference
	PYTHONSAFEPATH=1 $(BIN)/python -m tokenmill.bench.corpus --out $(CORPUS) --per-family 18 \
		--family itl_prefill_interference --split tune
	# and five fresh evaluation runs of it, recorded after its rule's last change
	PYTHONSAFEPATH=1 $(BIN)/python -m tokenmill.bench.corpus --out $(CORPUS) --per-family 20 \
		--family itl_prefill_interference --split eval
	# tune and eval siblings of the two families slowest to detect: queueing (some with 5 s windows) and periodic
	PYTHONSAFEPATH=1 $(BIN)/python -m tokenmill.bench.corpus --out $(CORPUS) --per-family 15 \
		--family ttft_queueing --family periodic_itl_spikes \
		$(foreach i,4 5 6 7 8 9 12,--run ttft_queueing-$(i)) \
		$(foreach i,8 9 10 12 14,--run periodic_itl_spikes-$(i))
	# a third set; the periodic runs all with 2 clients and a job every 4 s (the slowest held-out run's kind)
	PYTHONSAFEPATH=1 $(BIN)/python -m tokenmill.bench.corpus --out $(CORPUS) --per-family 30 \
		--family ttft_queueing --family periodic_itl_spikes \
		$(foreach i,10 11 14 17 18,--run ttft_queueing-$(i)) \
		$(foreach i,15 16 22 26 27,--run periodic_itl_spikes-$(i))
	# a fourth: queueing with 5 s windows and pools near the top of the range (a run whose pool
	# ran the 2x step's clients at once fails the family's label check and is not written)
	PYTHONSAFEPATH=1 $(BIN)/python -m tokenmill.bench.corpus --out $(CORPUS) --per-family 40 \
		--family ttft_queueing $(foreach i,20 21 27 32,--run ttft_queueing-$(i))

accuracy: $(STAMP)
	$(BIN)/python benchmarks/diagnosis_accuracy.py --corpus $(CORPUS) --split eval

# the factorial corpus (bench/factorial.py): traffic shape × fault × magnitude and a healthy twin
# of every shape, the small plan (91 runs, 35-50 s of traffic each), tune shapes first; alone on
# the machine, resumable. Then the diagnoser on its held-out shapes.
FACTORIAL ?= benchmarks/data/factorial_corpus
factorial: model
	PYTHONSAFEPATH=1 $(BIN)/python -m tokenmill.bench.factorial --out $(FACTORIAL) --plan small \
		--split tune
	PYTHONSAFEPATH=1 $(BIN)/python -m tokenmill.bench.factorial --out $(FACTORIAL) --plan small \
		--split heldout

# the blind sets (benchmarks/blind_set*/: situations written apart from the rules), recorded
# without reading a diagnosis; the newest, never scored, is scored with the held-out shapes, once
# (the first set, scored before, is tune material now)
BLIND_SET ?= benchmarks/blind_set_3
BLIND ?= benchmarks/data/blind_set_3
blind-set: model
	PYTHONSAFEPATH=1 $(BIN)/python benchmarks/blind_set/blind.py --set $(BLIND_SET) --all \
		--record $(BLIND)

generalization: $(STAMP)
	$(BIN)/python benchmarks/diagnosis_generalization.py --corpus $(FACTORIAL) --split heldout \
		--blind $(BLIND)

# tokenmill plan's predictions against real runs, each repeated 3 times (~70 minutes, alone on
# the machine)
plan-validation: model
	PYTHONSAFEPATH=1 $(BIN)/python benchmarks/plan_validation.py --rate 0.4 --requests 80 \
		--cases 'rate=0.5;rate=1.5;rate=2;max_num_seqs=4;replicas=2,rate=2' --no-recommend

plan-capacity: model
	PYTHONSAFEPATH=1 $(BIN)/python benchmarks/plan_capacity.py

# a plan from a proxy's recording of llama.cpp's llama-server, against the real server at twice
# the rate (~15 minutes, alone on the machine)
plan-upstream: model
	PYTHONSAFEPATH=1 $(BIN)/python benchmarks/plan_upstream.py

plan-scale: $(STAMP)
	PYTHONSAFEPATH=1 $(BIN)/python benchmarks/plan_scale.py
