# solar: set-up and the two commands of the README.
#   make demo   create .venv, generate a PtychoNN-style file, describe it, simulate the loading policies on it,
#               plan a 2-rank job and benchmark the solar loader against the PyTorch baseline (cold cache)
#   make test   create .venv, run the unit tests, then the MPI tests under mpiexec -n 2
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
DATA   ?= data/ptychonn
NP     ?= 2

.PHONY: env demo test test-unit test-mpi clean

$(VENV)/.installed: setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,plot,mpich]'
	touch $@

env: $(VENV)/.installed

demo: env
	$(VENV)/bin/solar gen ptychonn $(DATA) --samples 2048
	$(VENV)/bin/solar inspect $(DATA)
	$(VENV)/bin/solar simulate $(DATA) -P 8 -b 32 --epochs 4 --buffer-fraction 0.25 0.5 0.9 --plot $(DATA)/hit-rate.png
	$(VENV)/bin/solar plan $(DATA) -P $(NP) -b 32 --epochs 3 --buffer-fraction 0.5 -o $(DATA)/plan.h5
	$(VENV)/bin/mpiexec -n $(NP) $(VENV)/bin/solar bench $(DATA) --epochs 3 --buffer-fraction 0.5 --cold

test-unit: env
	$(PY) -m pytest -q tests

test-mpi: env
	timeout 900 $(VENV)/bin/mpiexec -n $(NP) $(PY) -m pytest -q -p no:cacheprovider -m mpi tests

test: test-unit test-mpi

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
