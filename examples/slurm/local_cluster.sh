#!/usr/bin/env bash
# A single-node SLURM cluster on this machine, for trying the examples and for the tests.
#
#   examples/slurm/local_cluster.sh start [DIR]   # munged + slurmctld + slurmd; prints SLURM_CONF
#   export SLURM_CONF=DIR/slurm.conf              # what sbatch, squeue, scontrol need
#   examples/slurm/local_cluster.sh stop [DIR]    # cancels the jobs, then ends the three daemons
#   examples/slurm/local_cluster.sh status [DIR]
#
# Needs Debian's `slurm-wlm munge` (apt-get install -y slurm-wlm munge) and root, since it starts
# the daemons by hand (no systemd). Everything (config, key, state, logs, pid files) lives under
# DIR (default /tmp/ddp-recipes-slurm); `stop` ends only the processes named by its pid files.
# Starting twice is harmless: a running cluster is left as it is.
set -euo pipefail
export PATH="/usr/sbin:/sbin:$PATH"

cmd=${1:-}
dir=$(realpath -m "${2:-${LOCAL_SLURM_DIR:-/tmp/ddp-recipes-slurm}}")
conf="$dir/slurm.conf"
export SLURM_CONF="$conf"
socket="$dir/munge/munge.socket"
daemons=(slurmd slurmctld munged)  # the order they are stopped in

alive() { [[ -s "$dir/$1.pid" ]] && kill -0 "$(cat "$dir/$1.pid")" 2>/dev/null; }

node_state() { sinfo -h -N -o '%t' 2>/dev/null | head -n 1; }

wait_for() {  # wait_for SECONDS COMMAND...: poll until the command succeeds
    local deadline=$((SECONDS + $1)); shift
    until "$@"; do
        ((SECONDS < deadline)) || return 1
        sleep 0.2
    done
}

write_conf() {
    local node ports="${LOCAL_SLURM_PORT:-6817}"
    node=$(slurmd -C | head -n 1)  # NodeName=... CPUs=... RealMemory=...
    cat >"$conf" <<EOF
# Written by examples/slurm/local_cluster.sh: one node, everything under $dir.
ClusterName=ddp-recipes-local
SlurmctldHost=$(hostname -s)
SlurmUser=root
SlurmctldPort=$ports
SlurmdPort=$((ports + 1))
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$socket
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
MinJobAge=300
KillWait=5
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
$node
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
    alive munged && return 0
    mkdir -p "$dir/munge"
    chmod 755 "$dir/munge"
    [[ -s "$dir/munge.key" ]] || mungekey -c -k "$dir/munge.key"
    chmod 600 "$dir/munge.key"
    munged --socket="$socket" --key-file="$dir/munge.key" --pid-file="$dir/munged.pid" \
        --log-file="$dir/munged.log" --seed-file="$dir/munged.seed" --force
    wait_for 10 test -S "$socket"
}

start() {
    command -v slurmctld >/dev/null && command -v munged >/dev/null || {
        echo "error: slurmctld or munged not found; install them: apt-get install -y slurm-wlm munge" >&2
        exit 1
    }
    mkdir -p "$dir/state" "$dir/spool"
    [[ -f "$conf" ]] || write_conf
    start_munge
    alive slurmctld || slurmctld -f "$conf"
    alive slurmd || slurmd -f "$conf"
    # `idle*` would be a node that does not answer yet: wait for exactly `idle` (or busy).
    # A loaded machine can take a while to register the node: 60 s before giving up.
    if ! wait_for 60 bash -c '[[ $(sinfo -h -N -o %t 2>/dev/null | head -n 1) =~ ^(idle|mix|alloc)$ ]]'; then
        echo "error: the node did not come up (state '$(node_state)'); the logs' last lines:" >&2
        tail -n 15 "$dir"/*.log >&2 || true
        exit 1
    fi
    echo "SLURM_CONF=$conf"
}

stop() {
    if alive slurmctld; then
        local jobs
        jobs=$(squeue -h -o %i 2>/dev/null || true)
        # slurmstepd outlives slurmd: cancel the jobs first, while the controller still runs.
        if [[ -n "$jobs" ]]; then
            # shellcheck disable=SC2086
            scancel $jobs 2>/dev/null || true
            wait_for 30 bash -c '[[ -z $(squeue -h -o %i 2>/dev/null) ]]' || true
        fi
    fi
    local d pid
    for d in "${daemons[@]}"; do
        alive "$d" || continue
        pid=$(cat "$dir/$d.pid")
        kill "$pid" 2>/dev/null || true
        wait_for 15 bash -c "! kill -0 $pid 2>/dev/null" || kill -9 "$pid" 2>/dev/null || true
    done
    rm -f "$dir"/*.pid
}

status() {
    local d
    for d in munged slurmctld slurmd; do
        if alive "$d"; then echo "$d: running (pid $(cat "$dir/$d.pid"))"; else echo "$d: stopped"; fi
    done
    alive slurmctld && sinfo -N
    return 0
}

case "$cmd" in
start) start ;;
stop) stop ;;
status) status ;;
*)
    echo "usage: $0 start|stop|status [DIR]" >&2
    exit 2
    ;;
esac
