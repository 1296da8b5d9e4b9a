#!/usr/bin/env bash
# One prepared check of solar on a GPU machine with no network, in about 5 minutes on 16 cores.
#
#   benchmarks/gpu_check.sh OUTDIR [SECTION ...]      (sections: basics, cores, bench, conv, resident, nodes,
#                                                          depth, gil, reads, sync, eqmem, neighbours, kvikio,
#                                                          aio, process;
#                                                          default basics cores)
#
# It generates the data, trains the examples on CUDA, runs `solar bench --device cuda` cold, and writes
# into OUTDIR (what comes back from such a machine: 8 files at most, so few and named):
#   summary.md    the short table (also printed at the end), the GPU and the commands
#   summary.json  every figure of the summary
#   bench-*.json  `solar bench --json` reports (bench-conv, bench-resident); nodes.json those of section nodes
#   hit-path.json, device-buffer.json   the cores section's benchmarks
#   check.log     every step's command, output, exit status and seconds
#   train.jsonl   the examples' --log-json records, each tagged with its run
# Sections (one per issue that measures on a GPU; each appends to the files above):
#   basics   issue 23: the examples on CUDA (both loaders, bf16), the loop fed an all-resident plan against
#            the same loop fed one resident batch, fp32 deterministic fidelity of the two loaders, the
#            Lightning and Accelerate variants, `solar bench --device cuda --model conv` cold
#   cores    issue 24: the hit path of one rank (benchmarks/hit_path.py: all-resident SolarLoader with
#            cpus 1, 4 and all but one core against a one-thread np.take of the same bytes; hit-path.json),
#            `solar bench --device cuda --model conv` on an all-resident plan, host and device buffer
#            (bench-resident.json: {"host": report, "device": report}), and the
#            device buffer tier against the host buffer (benchmarks/device_buffer_check.py: the same batches,
#            and each tier's samples/s to the GPU all resident (f=$ALL) and at 0.5; device-buffer.json)
#   bench    the `solar bench` steps of both sections alone (bench-conv, bench-resident): a rerun
#   conv     the cold `solar bench --device cuda --model conv` of basics alone (bench-conv)
#   depth    issue 24: that bench, solar alone, with --threads 16 and 64 (reads in flight; depth.json)
#   gil      issue 24: that bench, solar alone, with Python's GIL switch interval against solar's 0.5 ms (twice
#            each, interleaved) and without the model (gil.json)
#   reads    issue 24: that bench, solar alone, planned with --reads-in-flight 1 and 4, twice each, and the CPU
#            seconds of each of the rank's thread groups per epoch (benchmarks/thread_cpu.py; reads.json)
#   sync     issue 25: the gzip file on R ranks, solar alone, node pool against a buffer per rank with --step-sync
#            (the ranks wait for each other after every step, as in DDP), twice each (sync.json)
#   eqmem    issue 25: nodes' contiguous run with every loader under --equal-memory alone (eqmem.json)
#   neighbours issue 25: --neighbour-reads against each block on its own, one rank (conv) and R ranks, cold,
#            twice each interleaved (neighbours.json)
#   kvikio   issue 24: 1 GiB of the contiguous file's blocks read cold straight into GPU memory with KvikIO against
#            solar's pread reader and one copy a step, and the disk's own rate, 16 and 64 in flight (kvikio.json)
#   aio      issue 24: the pread reader's native AIO (the default on ext4/xfs/btrfs) against its threads, cold,
#            f=0.5, solar alone: one rank with the conv net, and R ranks, interleaved, twice each (aio.json)
#   process  issue 24: solar's loader in a process of its own per rank (--loader-process) against in the training
#            process, a buffer per rank, the same pairs as aio (process.json)
#   resident the all-resident `solar bench` pair alone (bench-resident)
#   nodes    issue 25: SOLAR_GPU_RANKS (8) ranks on the node, cold, the node pool (the default) against a buffer
#            per rank (--no-node-pool), on the contiguous file (with every baseline) and on a gzip one
#            (4 samples a chunk; also against --ranks-per-node 1): storage bytes against the file, limit ratio,
#            samples/s (summary.json, nodes.json)
#
# What the machine needs: python3 with torch (CUDA), h5py, numba, numpy, mpi4py; the checkout (PYTHONPATH is
# set here).  MPICH comes as a wheel in .whl/ (GPU machines have mpi4py but no MPI library); make it here with
#   benchmarks/gpu_wheels.sh
# and carry .whl along.  Without mpiexec the bench steps are skipped (said in the summary).
# Environment: SOLAR_GPU_SAMPLES (default 4096), SOLAR_GPU_SIZE (128), SOLAR_GPU_BATCH (128),
# SOLAR_GPU_WORKERS (8: the baseline's DataLoader workers), SOLAR_GPU_BUDGET (290 seconds for all steps),
# SOLAR_GPU_DEVICE (cuda; cpu runs the same steps on the CPU: a dry run of this script on a machine without
# a GPU, with small SOLAR_GPU_* sizes), SOLAR_GPU_WORK (scratch folder for data; default a new /tmp folder).
set -uo pipefail
OUT=${1:?usage: benchmarks/gpu_check.sh OUTDIR [SECTION ...]}
shift
SECTIONS=${*:-basics cores}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=$(command -v "${PYTHON:-python3}")  # absolute: mpiexec may search another PATH
N=${SOLAR_GPU_SAMPLES:-4096}
SIZE=${SOLAR_GPU_SIZE:-128}
B=${SOLAR_GPU_BATCH:-128}
WORKERS=${SOLAR_GPU_WORKERS:-8}
# "all resident": the buffer fraction is the memory per rank, batches and reads in flight included, so 1.0 holds
# about 0.9-0.96 of the data (`solar plan` says so); the fraction that holds all of it is searched for once the
# data is made (benchmarks/hit_path.py's all_resident), unless given here
ALL=${SOLAR_GPU_ALL_FRACTION:-}
BUDGET=${SOLAR_GPU_BUDGET:-290}
DEVICE=${SOLAR_GPU_DEVICE:-cuda}
WORK=${SOLAR_GPU_WORK:-$(mktemp -d /tmp/solar-gpu.XXXXXX)}
mkdir -p "$OUT" "$WORK"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} NUMBA_CACHE_DIR=$WORK/numba HDF5_USE_FILE_LOCKING=FALSE
# an Open MPI mpiexec (some GPU images have one) refuses root without these; MPICH ignores them
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PYTHONUNBUFFERED=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=${MASTER_PORT:-29561}
LOG=$OUT/check.log
STEPS=$WORK/steps.tsv
START=$(date +%s)
: >"$LOG"
: >"$STEPS"
: >"$OUT/train.jsonl"
cd "$ROOT" || exit 2

say() { echo "[gpu_check $(( $(date +%s) - START ))s] $*" | tee -a "$LOG" >&2; }

# run NAME LIMIT CMD...: the command under `timeout` (its limit, at most what is left of the budget), its
# output into check.log (stdout into $STDOUT instead where that is set); one line per step in steps.tsv
# (name, status, seconds)
run() {
    local name=$1 limit=$2 stdout=${STDOUT:-$LOG}
    shift 2
    local left=$(( BUDGET - ($(date +%s) - START) ))
    if (( left < 10 )); then
        say "skip $name: the ${BUDGET}s budget is spent"
        printf '%s\tskipped\t0\n' "$name" >>"$STEPS"
        return 1
    fi
    (( limit > left )) && limit=$left
    say "run $name (limit ${limit}s): $*"
    local t0 rc
    t0=$(date +%s.%N)
    timeout --kill-after=10 "$limit" "$@" 2>>"$LOG" >>"$stdout"
    rc=$?
    local secs
    secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    say "$name: exit $rc in ${secs}s"
    printf '%s\t%s\t%s\n' "$name" "$rc" "$secs" >>"$STEPS"
    return $rc
}

# drop the data files' pages from the page cache (posix_fadvise DONTNEED): the data is read cold, the libraries
# are not (dropping the whole cache would time torch and CUDA's libraries paging back in, in the first steps)
drop_cache() {
    command sync  # the coreutils command, not this script's section of that name
    "$PY" -c "import os,sys
for p in sys.argv[1:]:
    fd = os.open(p, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)" "$@"
}

# the examples' --log-json records, tagged with the run, into train.jsonl
keep_log() {
    local tag=$1 path=$2
    [ -f "$path" ] && "$PY" -c "import json,sys
for line in open(sys.argv[1]):
    rec = json.loads(line)
    if 'index' in rec:
        continue   # per-step sample ids: not needed here, and large
    rec['run'] = sys.argv[2]
    print(json.dumps(rec))" "$path" "$tag" >>"$OUT/train.jsonl"
}

# ------------------------------------------------------------------ the machine
say "solar gpu check: sections [$SECTIONS], $N samples of ${SIZE}x${SIZE}, local batch $B, device $DEVICE"
{
    echo "== machine"
    uname -a
    nproc
    free -g | head -2
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$PY" -c "import sys, torch, h5py, numpy, numba; print('python', sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, 'h5py', h5py.__version__, 'numpy', numpy.__version__, 'numba', numba.__version__)"
    # a device plan's batches pass DataLoader(pin_memory=True) only where its pin step asks the batch's own
    # pin_memory before it looks into the dict (docs/torch.md): record what this torch does
    "$PY" -c "from torch.utils.data._utils.pin_memory import pin_memory as p
class D(dict):
    def pin_memory(self, device=None): return 'own'
print('DataLoader pin step asks a dict batch its own pin_memory first:', p(D(a=1)) == 'own')"
} >>"$LOG" 2>&1
GPU=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')" 2>/dev/null)
say "GPU: ${GPU:-none}"
if [ "$DEVICE" = cuda ] && [ "$GPU" = none ]; then
    say "no CUDA device here: run with SOLAR_GPU_DEVICE=cpu for a dry run"
    exit 2
fi
CPU_FLAG=()
[ "$DEVICE" = cpu ] && CPU_FLAG=(--cpu)

# MPICH from the carried wheel (pip --target would drop its lib/): unpacked, on PATH and LD_LIBRARY_PATH
if ! command -v mpiexec >/dev/null; then
    for whl in "$ROOT"/.whl/mpich-*.whl; do
        [ -f "$whl" ] || continue
        "$PY" -m zipfile -e "$whl" "$WORK/mpich" && chmod +x "$WORK"/mpich/*/data/bin/* 2>/dev/null
        for d in "$WORK"/mpich/*/data; do
            export PATH=$d/bin:$PATH LD_LIBRARY_PATH=$d/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
        done
    done
fi
# other carried wheels (deflate, numcodecs, mpi4py for this Python): installed into the scratch folder
if ls "$ROOT"/.whl/*.whl 2>/dev/null | grep -qv '/mpich-'; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" \
        $(ls "$ROOT"/.whl/*.whl | grep -v '/mpich-') >>"$LOG" 2>&1 && export PYTHONPATH=$PYTHONPATH:$WORK/site
fi
# --bind-to none: Open MPI binds a job of one or two ranks to one core each by default, which leaves solar (and the
# baselines' DataLoader workers) one core of the machine's 16 (seen on the H200 machine: its image has Open MPI)
MPIEXEC=$(command -v mpiexec || true)
if [ -n "$MPIEXEC" ] && "$PY" -c "from mpi4py import MPI" >>"$LOG" 2>&1; then
    say "MPI: $MPIEXEC"
else
    MPIEXEC=""
    say "no MPI (no mpiexec or mpi4py cannot load it): the bench steps are skipped"
fi
SOLAR=("$PY" -m solar)

# ------------------------------------------------------------------ data
D=$WORK/ptycho
V=$WORK/ptycho-valid
run gen 120 "${SOLAR[@]}" gen ptychonn "$D" --samples "$N" --size "$SIZE" --overwrite --no-progress
run gen-valid 30 "${SOLAR[@]}" gen ptychonn "$V" --samples 256 --size "$SIZE" --seed 1 --overwrite --no-progress
# numba's cache ($NUMBA_CACHE_DIR, new here) filled once, by one step of a loader on the held-out file and on a
# gzip file of a few samples: otherwise every first run below compiles the kernels in its epoch 0 (1.6-1.9 s)
run gen-warm 30 "${SOLAR[@]}" gen ptychonn "$WORK/warm-gzip" --samples 64 --size "$SIZE" --storage gzip --overwrite \
    --no-progress
run warm-kernels 120 "$PY" -c "import sys, solar
from solar.loader import SolarLoader
for data in sys.argv[1:]:
    solar.plan(data, world_size=1, local_batch=4, epochs=1, buffer_fraction=0.5, out=data + '-warm.h5').close()
    with SolarLoader(data + '-warm.h5', data) as loader:
        next(iter(loader))" "$V" "$WORK/warm-gzip"
if [ -z "$ALL" ]; then  # one rank, local batch $B, 3 epochs: as every all-resident step below plans
    ALL=$("$PY" -c "import os, sys, tempfile
sys.path.insert(0, 'benchmarks')
import solar
from hit_path import all_resident
print(all_resident(solar, sys.argv[1], int(sys.argv[2]), 3, os.path.join(tempfile.mkdtemp(), 'plan.h5')))" \
        "$D" "$B" 2>>"$LOG") || ALL=1.15
    say "all resident: --buffer-fraction $ALL"
fi

TRAIN=(examples/train_ptychonn.py "$D" --stats-samples 512 --valid "$V" --valid-samples 256 "${CPU_FLAG[@]}")

# ------------------------------------------------------------------ issue 23: basics
basics() {
    # 1. the examples on the device, both loaders, the way GPU users run them (bf16, channels_last), 2 epochs
    drop_cache "$D"/*.h5
    run train-solar 90 "$PY" "${TRAIN[@]}" --loader solar --epochs 2 --local-batch "$B" \
        --plan "$WORK/plan-b$B.h5" --replan --log-json "$WORK/train-solar.jsonl"
    keep_log train-solar "$WORK/train-solar.jsonl"
    drop_cache "$D"/*.h5
    run train-baseline 60 "$PY" "${TRAIN[@]}" --loader baseline --workers "$WORKERS" --epochs 2 \
        --local-batch "$B" --log-json "$WORK/train-baseline.jsonl"
    keep_log train-baseline "$WORK/train-baseline.jsonl"
    # 2. the loop fed an all-resident plan (epochs >= 1 from memory) against the same loop fed one resident batch
    run train-all-resident 60 "$PY" "${TRAIN[@]}" --loader solar --epochs 3 --local-batch "$B" --amp bf16 \
        --buffer-fraction "$ALL" --plan "$WORK/plan-all-b$B.h5" --replan --log-json "$WORK/train-all-resident.jsonl"
    keep_log train-all-resident "$WORK/train-all-resident.jsonl"
    run train-resident-batch 45 "$PY" "${TRAIN[@]}" --loader resident --epochs 3 --local-batch "$B" --amp bf16 \
        --log-json "$WORK/train-resident-batch.jsonl"
    keep_log train-resident-batch "$WORK/train-resident-batch.jsonl"
    # 3. solar bench on the device, cold, solar and every baseline feeding the conv step
    if [ -n "$MPIEXEC" ]; then
        STDOUT=$OUT/bench-conv.json run bench-conv 150 "$MPIEXEC" --bind-to none -n 1 "${SOLAR[@]}" bench "$D" -b "$B" --epochs 3 \
            --device "$DEVICE" --model conv --num-workers "$WORKERS" --cold \
            --baseline-time-limit 20 --schedule "$WORK/bench-plan.h5" --json
    fi
    # 4. fidelity: fp32, deterministic kernels, the two loaders' per-epoch losses (local batch 64)
    run fidelity-solar 60 "$PY" "${TRAIN[@]}" --loader solar --epochs 2 --local-batch 64 --amp none \
        --no-channels-last --deterministic --plan "$WORK/plan-b64.h5" --replan --log-json "$WORK/fid-solar.jsonl"
    keep_log fidelity-solar "$WORK/fid-solar.jsonl"
    run fidelity-baseline 60 "$PY" "${TRAIN[@]}" --loader baseline --workers "$WORKERS" --epochs 2 \
        --local-batch 64 --amp none --no-channels-last --deterministic --log-json "$WORK/fid-baseline.jsonl"
    keep_log fidelity-baseline "$WORK/fid-baseline.jsonl"
    # 5. the framework variants on the device, one epoch each on the solar plan of step 1
    run lightning 60 "$PY" examples/train_ptychonn_lightning.py "$WORK/plan-b$B.h5" --epochs 1 --stats-samples 512 \
        --precision "$( [ "$DEVICE" = cuda ] && echo bf16-mixed || echo 32-true )"
    run accelerate 60 "$PY" examples/train_ptychonn_accelerate.py "$WORK/plan-b$B.h5" --epochs 1 \
        --stats-samples 512 --mixed-precision "$( [ "$DEVICE" = cuda ] && echo bf16 || echo no )" "${CPU_FLAG[@]}"
}

# ------------------------------------------------------------------ issue 24: cores
# `solar bench --model conv` on an all-resident plan: the host buffer, then the device buffer (--buffer-device),
# one file with both
bench_resident() {
    if [ -n "$MPIEXEC" ]; then
        STDOUT=$WORK/br-host.json run bench-resident 60 "$MPIEXEC" --bind-to none -n 1 "${SOLAR[@]}" bench "$D" -b "$B" \
            --epochs 3 --buffer-fraction "$ALL" --device "$DEVICE" --model conv --only solar --cold \
            --schedule "$WORK/bench-resident-plan.h5" --json
        STDOUT=$WORK/br-device.json run bench-resident-device 60 "$MPIEXEC" --bind-to none -n 1 "${SOLAR[@]}" bench "$D" -b "$B" \
            --epochs 3 --buffer-fraction "$ALL" --device "$DEVICE" --model conv --only solar --cold \
            --buffer-device "$DEVICE" --schedule "$WORK/bench-resident-plan.h5" --json
        "$PY" -c "import json, os, sys
sys.path.insert(0, 'benchmarks')
from gpu_summary import parse_report
out = {}
for k, p in (('host', sys.argv[1]), ('device', sys.argv[2])):
    if os.path.exists(p) and os.path.getsize(p):
        out[k] = parse_report(open(p).read())  # not the escape sequences mpiexec may add
json.dump(out, open(sys.argv[3], 'w'), indent=1)" "$WORK/br-host.json" "$WORK/br-device.json" "$OUT/bench-resident.json"
    fi
}

cores() {
    local all=$(( $(nproc) - 1 ))
    (( all < 2 )) && all=2
    STDOUT=$OUT/hit-path.json run hit-path 90 "$PY" benchmarks/hit_path.py "$D" --batch "$B" --epochs 3 \
        --cpus 1 4 "$all" --repeat 2 --json
    bench_resident
    STDOUT=$OUT/device-buffer.json run device-buffer 90 "$PY" benchmarks/device_buffer_check.py "$D" --batch "$B" \
        --epochs 3 --fractions "$ALL" 0.5 --device "$DEVICE" --json
}

# merge OUTFILE PREFIX KEY...: the reports $WORK/PREFIX-KEY.json in one JSON file {KEY: report} (8 files at most
# come back from the machine); a command's output that is no report is kept as {"raw": its text}
merge() {
    local out=$1 prefix=$2
    shift 2
    "$PY" -c "import json, os, sys
sys.path.insert(0, 'benchmarks')
from gpu_summary import parse_report
work, prefix, out = sys.argv[1:4]
res = {}
for k in sys.argv[4:]:
    p = os.path.join(work, prefix + '-' + k + '.json')
    if os.path.exists(p) and os.path.getsize(p):
        text = open(p, errors='replace').read()
        try:
            res[k] = parse_report(text)
        except ValueError:
            res[k] = {'raw': text}
json.dump(res, open(out, 'w'), indent=1)" "$WORK" "$prefix" "$out" "$@"
}

# ------------------------------------------------------------------ issue 25: nodes
# R ranks on this one node (SOLAR_GPU_RANKS, default 8), cold: the contiguous file with every baseline and the
# default node pool, then solar alone with --no-node-pool; a gzip file of half the samples (4 a chunk), solar
# alone three ways (also --ranks-per-node 1); the contiguous file with every loader under --equal-memory.  The six
# reports go into one file, nodes.json (8 files at most come back from the machine); summary.json keeps their
# figures
nodes() {
    [ -n "$MPIEXEC" ] || return 0
    local R=${SOLAR_GPU_RANKS:-8} G=$WORK/ptycho-gzip
    run gen-gzip 120 "${SOLAR[@]}" gen ptychonn "$G" --samples $(( N / 2 )) --size "$SIZE" --storage gzip \
        --overwrite --no-progress
    local bench=("$MPIEXEC" --bind-to none -n "$R" "${SOLAR[@]}" bench --epochs 3 --buffer-fraction 0.5 --cold --json
                 --no-progress)
    STDOUT=$WORK/nodes-contiguous-node.json run nodes-contiguous-node 120 "${bench[@]}" "$D" \
        --baseline-time-limit 15
    STDOUT=$WORK/nodes-contiguous-rank.json run nodes-contiguous-rank 60 "${bench[@]}" "$D" --only solar \
        --no-node-pool
    STDOUT=$WORK/nodes-gzip-node.json run nodes-gzip-node 60 "${bench[@]}" "$G" --only solar
    STDOUT=$WORK/nodes-gzip-rank.json run nodes-gzip-rank 60 "${bench[@]}" "$G" --only solar --no-node-pool
    # issue 25's own comparison: a node plan of one rank a node
    STDOUT=$WORK/nodes-gzip-rpn1.json run nodes-gzip-rpn1 60 "${bench[@]}" "$G" --only solar --ranks-per-node 1
    # the contiguous file again with every loader under the same memory (a cgroup counting the page cache, which
    # memmap's readahead otherwise has without limit); ends at once with a clear error where cgroups are missing
    STDOUT=$WORK/nodes-contiguous-eqmem.json run nodes-contiguous-eqmem 120 "${bench[@]}" "$D" \
        --baseline-time-limit 15 --equal-memory
    # the six reports in one file (nodes.json: {"contiguous-node": report, ...})
    merge "$OUT/nodes.json" nodes contiguous-node contiguous-rank gzip-node gzip-rank gzip-rpn1 contiguous-eqmem
}

# issue 24: one rank's misses with more requests in flight (the default --threads 16 against 64), cold, f=0.5,
# solar alone; the H200's disk read best at depth 64 and epochs 1-2 read misses at 0.60-0.64 of that limit
depth() {
    [ -n "$MPIEXEC" ] || return 0
    local t
    for t in 16 64; do
        STDOUT=$WORK/depth-$t.json run depth-$t 60 "$MPIEXEC" --bind-to none -n 1 "${SOLAR[@]}" bench "$D" -b "$B" \
            --epochs 3 --device "$DEVICE" --model conv --only solar --cold --threads "$t" --json --no-progress
    done
    merge "$OUT/depth.json" depth 16 64
}

# issue 24: the GIL beside the training loop: one rank, cold, f=0.5, solar alone, the conv net on the GPU, with
# Python's switch interval (--switch-interval 0) against solar's default (0.0005), and the loader alone (--model
# none) for its own ceiling; gil.json
gil() {
    [ -n "$MPIEXEC" ] || return 0
    local one=("$MPIEXEC" --bind-to none -n 1 "${SOLAR[@]}" bench "$D" -b "$B" --epochs 3 --device "$DEVICE" --only solar
               --cold --json --no-progress)
    STDOUT=$WORK/gil-python.json run gil-python 60 "${one[@]}" --model conv --switch-interval 0
    STDOUT=$WORK/gil-default.json run gil-default 60 "${one[@]}" --model conv
    STDOUT=$WORK/gil-none.json run gil-none 60 "${one[@]}" --model none
    STDOUT=$WORK/gil-python2.json run gil-python2 60 "${one[@]}" --model conv --switch-interval 0
    STDOUT=$WORK/gil-default2.json run gil-default2 60 "${one[@]}" --model conv
    merge "$OUT/gil.json" gil python default none python2 default2
}

# issue 24: one rank's reads ahead: the cold conv bench, solar alone, planned with --reads-in-flight 1 (default) and 4
# (interleaved, twice each); reads.json (per epoch book_wait_max_s: the time the next step's reads waited for slots)
reads() {
    [ -n "$MPIEXEC" ] || return 0
    local one=("$MPIEXEC" --bind-to none -n 1 "${SOLAR[@]}" bench "$D" -b "$B" --epochs 3 --device "$DEVICE" --only solar
               --cold --json --no-progress --model conv)
    STDOUT=$WORK/reads-1.json run reads-1 60 "${one[@]}" --reads-in-flight 1
    STDOUT=$WORK/reads-4.json run reads-4 60 "${one[@]}" --reads-in-flight 4
    STDOUT=$WORK/reads-1b.json run reads-1b 60 "${one[@]}" --reads-in-flight 1
    STDOUT=$WORK/reads-4b.json run reads-4b 60 "${one[@]}" --reads-in-flight 4
    # where that rank's CPU goes, per thread group and epoch (no model, no MPI; benchmarks/thread_cpu.py)
    STDOUT=$WORK/reads-cpu.json run reads-cpu 60 "$PY" benchmarks/thread_cpu.py "$D" --world-size 1 -b "$B" \
        --epochs 3 --buffer-fraction 0.5 --json
    merge "$OUT/reads.json" reads 1 4 1b 4b cpu
}

# issue 24: unfiltered blocks straight into device memory with KvikIO (wheels in .whl/, benchmarks/gpu_wheels.sh)
# against solar's pread reader + one copy a step, and the disk's own rate, cold, 1 GiB of random 64 KiB blocks each,
# at 16 and 64 reads in flight; kvikio.json (benchmarks/kvikio_check.py)
kvikio() {
    STDOUT=$WORK/kvikio-16.json run kvikio-16 60 "$PY" benchmarks/kvikio_check.py "$D" --device "$DEVICE" --threads 16 --json
    STDOUT=$WORK/kvikio-64.json run kvikio-64 60 "$PY" benchmarks/kvikio_check.py "$D" --device "$DEVICE" --threads 64 --json
    merge "$OUT/kvikio.json" kvikio 16 64
}

# issue 25: the gzip file on R ranks, solar alone, the node pool against a buffer per rank with the ranks waiting for
# each other after every step (--step-sync, as DDP training does), twice each interleaved; sync.json
section_sync() {  # not sync(): that would shadow the command drop_cache runs
    [ -n "$MPIEXEC" ] || return 0
    local R=${SOLAR_GPU_RANKS:-8} G=$WORK/ptycho-gzip
    [ -f "$G/ptychonn.h5" ] || run gen-gzip 120 "${SOLAR[@]}" gen ptychonn "$G" --samples $(( N / 2 )) --size "$SIZE" \
        --storage gzip --overwrite --no-progress
    local bench=("$MPIEXEC" --bind-to none -n "$R" "${SOLAR[@]}" bench "$G" --epochs 3 --buffer-fraction 0.5 --cold --json
                 --no-progress --only solar --step-sync)
    STDOUT=$WORK/sync-node.json run sync-node 60 "${bench[@]}"
    STDOUT=$WORK/sync-rank.json run sync-rank 60 "${bench[@]}" --no-node-pool
    STDOUT=$WORK/sync-node2.json run sync-node2 60 "${bench[@]}"
    STDOUT=$WORK/sync-rank2.json run sync-rank2 60 "${bench[@]}" --no-node-pool
    merge "$OUT/sync.json" sync node rank node2 rank2
}

# issue 25: the contiguous file on R ranks with every loader under --equal-memory alone (section nodes' last run)
eqmem() {
    [ -n "$MPIEXEC" ] || return 0
    local R=${SOLAR_GPU_RANKS:-8}
    STDOUT=$WORK/eqmem.json run eqmem 150 "$MPIEXEC" --bind-to none -n "$R" "${SOLAR[@]}" bench "$D" --epochs 3 \
        --buffer-fraction 0.5 --cold --json --no-progress --baseline-time-limit 15 --equal-memory
    "$PY" -c "import json, os, sys
sys.path.insert(0, 'benchmarks')
from gpu_summary import parse_report
p = sys.argv[1]
text = open(p, errors='replace').read() if os.path.exists(p) else ''
try:
    out = parse_report(text)
except ValueError:
    out = {'raw': text}
json.dump(out, open(sys.argv[2], 'w'), indent=1)" "$WORK/eqmem.json" "$OUT/eqmem.json"
}

# One rank with the conv net and R ranks on the node, cold, f=0.5, solar alone, the options OFF against ON (words;
# no spaces inside one), interleaved, twice each; $OUT/NAME.json (keys one-off1, one-on1, many-off1, ...)
pairs_one_many() {
    [ -n "$MPIEXEC" ] || return 0
    local name=$1 on=$2 off=$3 R=${SOLAR_GPU_RANKS:-8} r
    local one=("$MPIEXEC" --bind-to none -n 1 "${SOLAR[@]}" bench "$D" -b "$B" --epochs 3 --device "$DEVICE" --only solar
               --cold --json --no-progress --model conv)
    local many=("$MPIEXEC" --bind-to none -n "$R" "${SOLAR[@]}" bench "$D" --epochs 3 --buffer-fraction 0.5 --cold --json
                --no-progress --only solar)
    for r in 1 2; do
        # shellcheck disable=SC2086 # $off and $on are words
        STDOUT=$WORK/$name-one-off$r.json run "$name-one-off$r" 60 "${one[@]}" $off
        STDOUT=$WORK/$name-one-on$r.json run "$name-one-on$r" 60 "${one[@]}" $on
        STDOUT=$WORK/$name-many-off$r.json run "$name-many-off$r" 60 "${many[@]}" $off
        STDOUT=$WORK/$name-many-on$r.json run "$name-many-on$r" 60 "${many[@]}" $on
    done
    merge "$OUT/$name.json" "$name" one-off1 one-on1 many-off1 many-on1 one-off2 one-on2 many-off2 many-on2
}

# issue 25, item 4: runs of neighbouring blocks read together (--neighbour-reads) against each block on its own, on
# the contiguous file (64 KiB blocks); neighbours.json (per epoch samples/s, storage bytes, and replay_gbps: the same
# reads replayed as fast as the disk takes them, which says whether the disk is request-bound)
neighbours() { pairs_one_many neighbours --neighbour-reads ""; }

# issue 24: native AIO (the pread reader's default on ext4/xfs/btrfs) against the thread pool's blocking reads;
# aio.json (per epoch samples/s, limit ratios, and reader_io: whether AIO read the files)
section_aio() { pairs_one_many aio '--reader-options {"aio":true}' '--reader-options {"aio":false}'; }

# issue 24, item 1: the loader in a process of its own per rank (--loader-process) against in the training process, a
# buffer per rank both times; process.json (per epoch samples/s, au and gpu_wait_fraction: whether the conv net's
# launches waited for the GIL beside the in-process loader)
section_process() { pairs_one_many process '--no-node-pool --loader-process' '--no-node-pool'; }

# the cold `solar bench --model conv` of section basics alone
bench_conv() {
    [ -n "$MPIEXEC" ] || return 0
    STDOUT=$OUT/bench-conv.json run bench-conv 150 "$MPIEXEC" --bind-to none -n 1 "${SOLAR[@]}" bench "$D" -b "$B" --epochs 3 \
        --device "$DEVICE" --model conv --num-workers "$WORKERS" --cold \
        --baseline-time-limit 20 --schedule "$WORK/bench-plan.h5" --json
}

for s in $SECTIONS; do
    case $s in
        basics) basics ;;
        cores) cores ;;
        bench) bench_conv; bench_resident ;;
        conv) bench_conv ;;
        depth) depth ;;
        resident) bench_resident ;;
        nodes) nodes ;;
        gil) gil ;;
        reads) reads ;;
        sync) section_sync ;;
        eqmem) eqmem ;;
        neighbours) neighbours ;;
        kvikio) kvikio ;;
        aio) section_aio ;;
        process) section_process ;;
        *) say "unknown section $s (sections: basics cores bench conv resident nodes depth gil reads sync eqmem neighbours kvikio aio)" ;;
    esac
done

"$PY" benchmarks/gpu_summary.py "$OUT" --steps "$STEPS" --gpu "$GPU" --device "$DEVICE" \
    --samples "$N" --size "$SIZE" --batch "$B" --workers "$WORKERS" --nodes-dir "$WORK" 2>>"$LOG"
[ -s "$OUT/train.jsonl" ] || rm -f "$OUT/train.jsonl"  # no example ran: one file fewer of the 8 that come back
say "done in $(( $(date +%s) - START ))s; results in $OUT"
