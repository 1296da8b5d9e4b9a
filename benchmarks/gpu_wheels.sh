#!/usr/bin/env bash
# Wheels a GPU machine without network needs for benchmarks/gpu_check.sh, downloaded here into .whl/
# (ignored by git; pass it to the device run with carry=[".whl"]): MPICH (its Python has mpi4py but no MPI
# library), deflate (solar's fast inflate, optional) and KvikIO with the two libraries it needs that the image
# lacks (section kvikio; the image has cuda-pathfinder, nvidia-cufile and cupy), for that machine's CPython 3.12
# on x86-64.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PY=${PYTHON:-python3}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl ${*:-mpich deflate kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 rapids-logger==0.3.0}
ls -la .whl
