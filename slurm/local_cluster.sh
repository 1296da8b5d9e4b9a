#!/usr/bin/env bash
# A one-machine SLURM cluster (slurmctld + slurmd on localhost, a munged of its own for
# authentication), to run slurm/plan_and_train.sbatch without a real cluster.  Needs root.
#
#   slurm/local_cluster.sh install   apt-get install slurm-wlm munge (start does it when missing)
#   slurm/local_cluster.sh start     write slurm.conf into the state folder, start a munged of its
#                                    own (own key and socket), slurmctld and slurmd; wait for the node
#   slurm/local_cluster.sh env       print the `export SLURM_CONF=...` line for sbatch/squeue/sinfo
#   slurm/local_cluster.sh status    daemons, node and queue
#   slurm/local_cluster.sh stop      cancel jobs, stop the three daemons (by PID), remove the state
#
# Environment: SOLAR_SLURM_STATE (state folder, default ${TMPDIR:-/tmp}/solar-slurm-$UID),
# SOLAR_SLURM_CPUS (default nproc), SOLAR_SLURM_MEMORY (MiB, default 85% of MemTotal),
# SOLAR_SLURM_CTLD_PORT / SOLAR_SLURM_SLURMD_PORT (6817 / 6818), SOLAR_SLURM_FIRST_JOB_ID
# (default from the clock), SOLAR_SLURM_OWNER_PID (stop the cluster when that process ends),
# KEEP_STATE=1 (stop keeps logs).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
STATE=${SOLAR_SLURM_STATE:-${TMPDIR:-/tmp}/solar-slurm-$(id -u)}
CONF=$STATE/slurm.conf
TEMPLATE=${SOLAR_SLURM_TEMPLATE:-$HERE/slurm.conf.example}

say() { echo "local_cluster: $*"; }
die() { echo "local_cluster: error: $*" >&2; exit 1; }

alive() {  # alive PIDFILE: true when the file names a running process
    [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

stop_process() {  # stop_process NAME PID: TERM, wait up to 15 s, then KILL
    local name=$1 pid=$2
    kill -0 "$pid" 2>/dev/null || return 0
    say "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
        say "$name did not stop in 15 s: KILL"
        kill -KILL "$pid" 2>/dev/null || true
    fi
}

stop_pid() {  # stop_pid NAME PIDFILE: stop the process the file names, remove the file
    if [[ -s $2 ]]; then stop_process "$1" "$(cat "$2")"; fi
    rm -f "$2"
}

# where the Debian/Ubuntu packages' own services write their PIDs (never used by this script's daemons)
SERVICE_PIDFILES=(/run/munge/munged.pid /run/slurmctld.pid /run/slurmd.pid /run/slurm/slurmctld.pid
                  /run/slurm/slurmd.pid)

live_service_pids() {  # the live PIDs named in SERVICE_PIDFILES, one per line
    local f
    for f in "${SERVICE_PIDFILES[@]}"; do
        if alive "$f"; then cat "$f"; fi
    done
}

install() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
        say "slurm-wlm and munge are installed ($(slurmctld -V))"
        return 0
    fi
    [[ $(id -u) == 0 ]] || die "installing needs root: apt-get install -y slurm-wlm munge"
    command -v apt-get >/dev/null || die "no apt-get: install slurm-wlm (slurmctld, slurmd, client) and munge yourself"
    say "installing slurm-wlm and munge with apt-get"
    local before pid
    before=" $(live_service_pids | tr '\n' ' ') "
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
    # with systemd, the packages start their services (munged at least): this cluster uses its own
    # daemons, so the ones the installation started are stopped again
    for pid in $(live_service_pids); do
        [[ $before == *" $pid "* ]] || stop_process "$(cat "/proc/$pid/comm" 2>/dev/null || echo daemon) (started by apt-get)" "$pid"
    done
}

# munged wants every folder above its socket searchable by all users, which a private state folder
# (a test's temporary folder) need not be: the socket gets a folder of its own under /tmp, named
# in $STATE/munge.dir
munge_socket() { echo "$(cat "$STATE/munge.dir")/munge.socket"; }

munge_works() { munge -S "$(munge_socket)" -n 2>/dev/null | unmunge -S "$(munge_socket)" >/dev/null 2>&1; }

make_munge_dir() {
    local dir
    dir=$(mktemp -d /tmp/solar-munge.XXXXXX) || die "cannot make a folder for munged's socket in /tmp"
    chmod 755 "$dir"
    echo "$dir" >"$STATE/munge.dir"
}

remove_munge_dir() {  # only a folder make_munge_dir made
    local dir
    dir=$(cat "$STATE/munge.dir" 2>/dev/null || true)
    if [[ $dir == /tmp/solar-munge.* ]]; then rm -rf -- "$dir"; fi
    rm -f "$STATE/munge.dir"
}

start_munge() {  # a munged of this cluster's own: own key (state folder) and socket
    (umask 077 && head -c 1024 /dev/urandom >"$STATE/munge.key")
    munged --socket="$(munge_socket)" --key-file="$STATE/munge.key" --pid-file="$STATE/munged.pid" \
        --log-file="$STATE/munged.log" --seed-file="$STATE/munged.seed" ||
        die "munged failed to start (see $STATE/munged.log)"
    for _ in $(seq 50); do munge_works && break; sleep 0.1; done
    munge_works || die "munged does not answer on $(munge_socket) (see $STATE/munged.log)"
    say "started munged (pid $(cat "$STATE/munged.pid"), socket $(munge_socket))"
}

watch_owner() {  # watch_owner PID: a watcher that stops this cluster once process PID has ended
    local owner=$1
    kill -0 "$owner" 2>/dev/null || die "SOLAR_SLURM_OWNER_PID=$owner is not a running process"
    SOLAR_SLURM_STATE=$STATE SOLAR_SLURM_WATCHER=1 setsid bash -c \
        'while kill -0 "$1" 2>/dev/null; do sleep 1; done; exec "$2" stop' watcher "$owner" "$HERE/local_cluster.sh" \
        </dev/null >>"$STATE/watcher.log" 2>&1 &
    echo $! >"$STATE/watcher.pid"
    say "watcher (pid $!) stops the cluster when process $owner ends"
}

write_conf() {
    local cpus=${SOLAR_SLURM_CPUS:-$(nproc)}
    local mem=${SOLAR_SLURM_MEMORY:-$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.85)}' /proc/meminfo)}
    [[ -f $TEMPLATE ]] || die "no template $TEMPLATE"
    sed -e "s|@STATE@|$STATE|g" -e "s|@CPUS@|$cpus|g" -e "s|@MEMORY@|$mem|g" -e "s|@MUNGE_SOCKET@|$(munge_socket)|g" \
        -e "s|@FIRST_JOB_ID@|${SOLAR_SLURM_FIRST_JOB_ID:-$(( $(date +%s) % 6000000 * 10 + 10 ))}|g" \
        -e "s|@CTLD_PORT@|${SOLAR_SLURM_CTLD_PORT:-6817}|g" -e "s|@SLURMD_PORT@|${SOLAR_SLURM_SLURMD_PORT:-6818}|g" \
        "$TEMPLATE" >"$CONF"
    if grep -v "^#" "$CONF" | grep -q "@[A-Z_]*@"; then die "unreplaced place-holders in $CONF"; fi
    say "wrote $CONF (CPUs=$cpus RealMemory=$mem MiB)"
}

start() {
    [[ $(id -u) == 0 ]] || die "this one-machine cluster runs its daemons as root (SlurmUser=root)"
    install
    if alive "$STATE/slurmctld.pid" || alive "$STATE/slurmd.pid"; then
        say "already running (state in $STATE); stop it first to restart"
        print_env
        return 0
    fi
    if [[ -d $STATE && ! -f $STATE/.solar-local-cluster ]] && [[ -n $(ls -A "$STATE") ]]; then
        die "$STATE exists and is not a local_cluster state folder: pick another SOLAR_SLURM_STATE"
    fi
    mkdir -p "$STATE/ctld" "$STATE/slurmd"
    touch "$STATE/.solar-local-cluster"
    chmod 700 "$STATE"
    if [[ -n ${SOLAR_SLURM_OWNER_PID:-} ]]; then watch_owner "$SOLAR_SLURM_OWNER_PID"; fi
    make_munge_dir
    write_conf
    start_munge
    export SLURM_CONF=$CONF
    slurmctld || die "slurmctld failed to start (see $STATE/slurmctld.log)"
    slurmd -N localhost || die "slurmd failed to start (see $STATE/slurmd.log)"
    local state=""
    for _ in $(seq 100); do
        state=$(sinfo -h -n localhost -o %T 2>/dev/null || true)
        [[ $state == idle* || $state == mixed* || $state == allocated* ]] && break
        sleep 0.2
    done
    if ! [[ $state == idle* || $state == mixed* || $state == allocated* ]]; then
        scontrol update nodename=localhost state=resume 2>/dev/null || true
        sleep 1
        state=$(sinfo -h -n localhost -o %T 2>/dev/null || true)
    fi
    [[ $state == idle* || $state == mixed* || $state == allocated* ]] ||
        die "node localhost is '${state:-unknown}' (see $STATE/slurmctld.log and $STATE/slurmd.log)"
    say "up: slurmctld pid $(cat "$STATE/slurmctld.pid"), slurmd pid $(cat "$STATE/slurmd.pid"), node localhost $state"
    print_env
}

print_env() {
    echo "export SLURM_CONF=$CONF"
}

status() {
    local any=0
    for d in slurmctld slurmd munged; do
        if alive "$STATE/$d.pid"; then
            say "$d running (pid $(cat "$STATE/$d.pid"))"; any=1
        else
            say "$d not running"
        fi
    done
    if [[ $any == 1 ]] && alive "$STATE/slurmctld.pid"; then
        export SLURM_CONF=$CONF
        sinfo || true
        squeue || true
        print_env
    fi
    [[ $any == 1 ]]
}

stop() {
    if [[ -f $CONF ]] && alive "$STATE/slurmctld.pid"; then
        export SLURM_CONF=$CONF
        local jobs
        jobs=$(squeue -h -o %i 2>/dev/null || true)
        if [[ -n $jobs ]]; then
            say "cancelling jobs: $(echo $jobs)"
            # shellcheck disable=SC2086
            scancel $jobs || true
            for _ in $(seq 50); do [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break; sleep 0.2; done
        fi
    fi
    stop_pid slurmd "$STATE/slurmd.pid"
    stop_pid slurmctld "$STATE/slurmctld.pid"
    stop_pid munged "$STATE/munged.pid"
    remove_munge_dir
    if [[ ${SOLAR_SLURM_WATCHER:-0} != 1 ]]; then stop_pid watcher "$STATE/watcher.pid"; fi
    if [[ ${KEEP_STATE:-0} == 1 ]]; then
        say "stopped; state and logs kept in $STATE"
    elif [[ -f $STATE/.solar-local-cluster ]]; then  # only a folder start made
        rm -rf -- "$STATE"
        say "stopped; removed $STATE"
    else
        say "not running"
    fi
}

case "${1:-}" in
    install) install ;;
    start) start ;;
    stop) stop ;;
    status) status ;;
    env) print_env ;;
    *) sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
