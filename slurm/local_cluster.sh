#!/usr/bin/env bash
# A one-machine SLURM cluster (slurmctld + slurmd on localhost, munge for authentication),
# to run slurm/plan_and_train.sbatch without a real cluster.  Needs root (a container or VM).
#
#   slurm/local_cluster.sh install   apt-get install slurm-wlm munge (start does it when missing)
#   slurm/local_cluster.sh start     write slurm.conf into the state folder, start munged (unless
#                                    one runs already), slurmctld and slurmd; wait for the node
#   slurm/local_cluster.sh env       print the `export SLURM_CONF=...` line for sbatch/squeue/sinfo
#   slurm/local_cluster.sh status    daemons, node and queue
#   slurm/local_cluster.sh stop      cancel jobs, stop the daemons it started (by PID), remove the state
#
# Environment: SOLAR_SLURM_STATE (state folder, default ${TMPDIR:-/tmp}/solar-slurm-$UID),
# SOLAR_SLURM_CPUS (default nproc), SOLAR_SLURM_MEMORY (MiB, default 85% of MemTotal),
# SOLAR_SLURM_CTLD_PORT / SOLAR_SLURM_SLURMD_PORT (6817 / 6818), KEEP_STATE=1 (stop keeps logs).
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

stop_pid() {  # stop_pid NAME PIDFILE: TERM, wait up to 15 s, then KILL
    local name=$1 file=$2 pid
    if ! [[ -s $file ]]; then return 0; fi
    pid=$(cat "$file")
    if kill -0 "$pid" 2>/dev/null; then
        say "stopping $name (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        if kill -0 "$pid" 2>/dev/null; then
            say "$name did not stop in 15 s: KILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    rm -f "$file"
}

install() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
        say "slurm-wlm and munge are installed ($(slurmctld -V))"
        return 0
    fi
    [[ $(id -u) == 0 ]] || die "installing needs root: apt-get install -y slurm-wlm munge"
    say "installing slurm-wlm and munge with apt-get"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
}

munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    if munge_works; then
        say "munged is already running: using it"
        return 0
    fi
    [[ -s /etc/munge/munge.key ]] || die "no /etc/munge/munge.key (reinstall munge, or create one with mungekey)"
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do munge_works && break; sleep 0.1; done
    munge_works || die "munged did not start (see /var/log/munge/munged.log)"
    cp /run/munge/munged.pid "$STATE/munged.pid"  # ours: stop ends it
    say "started munged (pid $(cat "$STATE/munged.pid"))"
}

write_conf() {
    local cpus=${SOLAR_SLURM_CPUS:-$(nproc)}
    local mem=${SOLAR_SLURM_MEMORY:-$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.85)}' /proc/meminfo)}
    [[ -f $TEMPLATE ]] || die "no template $TEMPLATE"
    sed -e "s|@STATE@|$STATE|g" -e "s|@CPUS@|$cpus|g" -e "s|@MEMORY@|$mem|g" \
        -e "s|@FIRST_JOB_ID@|$(( $(date +%s) % 6000000 * 10 + 10 ))|g" \
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
        elif [[ $d != munged ]]; then
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
    *) sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
