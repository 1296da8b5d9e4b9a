# solar: set-up and the two commands of the README.
#   make demo   create .venv, generate a PtychoNN-style file, describe it, simulate the loading policies on it,
#               plan a 2-rank job and benchmark the solar loader against the PyTorch baseline (cold cache),
#               then train the PtychoNN example on 2 ranks through solar and print a one-screen report
#   make test   create .venv, run the unit tests (on JOBS processes), then the MPI tests under mpiexec -n 2
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
DATA   ?= data/ptychonn
NP     ?= 2
TRAIN  ?= --epochs 2 --local-batch 16 --width 8 --depth 3
PORT   ?= 29517
# where pip takes torch from: empty = pip's own configuration; plain PyPI's Linux wheel brings the CUDA libraries
# (GBs), so on a machine that reaches the internet: TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
# unit tests on this many processes (pytest-xdist): the cores, 2 to 4 (each worker imports torch: ~0.7 GB)
JOBS   ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; [ $$n -lt 2 ] && n=2; echo $$n)

.PHONY: env demo test test-unit test-mpi clean

$(VENV)/.installed: setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[test,plot,mpich]'
	touch $@

env: $(VENV)/.installed

demo: env
	$(VENV)/bin/solar gen ptychonn $(DATA) --samples 2048 --overwrite
	$(VENV)/bin/solar inspect $(DATA)
	$(VENV)/bin/solar simulate $(DATA) -P 8 -b 32 --epochs 4 --buffer-fraction 0.25 0.5 0.9 --plot $(DATA)/hit-rate.png
	$(VENV)/bin/solar plan $(DATA) -P $(NP) -b 32 --epochs 3 --buffer-fraction 0.5 -o $(DATA)/plan.h5
	$(VENV)/bin/mpiexec -n $(NP) $(VENV)/bin/solar bench $(DATA) --epochs 3 --buffer-fraction 0.5 --cold --json \
	    --plot $(DATA)/bench.png > $(DATA)/bench.json
	$(VENV)/bin/solar gen ptychonn $(DATA)-valid --samples 128 --seed 1 --no-progress --overwrite
	$(VENV)/bin/solar simulate $(DATA) -P $(NP) -b 16 --epochs 2 --buffer-fraction 0.5 --ranks-per-node $(NP) \
	    --policies solar-peer ideal --json > $(DATA)/train-simulate.json
	MASTER_ADDR=127.0.0.1 MASTER_PORT=$(PORT) $(VENV)/bin/mpiexec -n $(NP) $(PY) examples/train_ptychonn.py $(DATA) \
	    --valid $(DATA)-valid $(TRAIN) --plan $(DATA)/train-plan.h5 --replan --buffer-fraction 0.5 \
	    --log-json $(DATA)/train.jsonl --plot $(DATA)/train-loss.png
	$(PY) examples/demo_report.py --bench $(DATA)/bench.json --simulate $(DATA)/train-simulate.json \
	    --train $(DATA)/train.jsonl --plots $(DATA)/bench.png $(DATA)/hit-rate.png $(DATA)/train-loss.png

test-unit: env
	$(PY) -m pytest -q -n $(JOBS) --dist loadgroup tests

test-mpi: env
	timeout 900 $(VENV)/bin/mpiexec -n $(NP) $(PY) -m pytest -q -p no:cacheprovider -m mpi tests

test: test-unit test-mpi

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
