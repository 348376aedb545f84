#!/usr/bin/env bash
# A one-node SLURM on this machine (Debian's slurm-wlm + munge), for tests/test_slurm.py and for trying
# `python -m headrace.training.launch --slurm` without a cluster.
#   tools/slurm_local.sh start [--install]   # install from apt if missing (needs root), start munged, slurmctld, slurmd
#   tools/slurm_local.sh stop                # stop the three daemons this script started
# State, config and logs live in $SLURM_LOCAL_DIR (default /tmp/headrace-slurm). The node is "localhost"
# with every CPU of the machine and no GPUs; jobs run as the calling user.
set -euo pipefail
DIR="${SLURM_LOCAL_DIR:-/tmp/headrace-slurm}"
CONF=/etc/slurm/slurm.conf

stop() {
    for name in slurmd slurmctld munged; do
        if [ -f "$DIR/$name.pid" ]; then
            kill "$(cat "$DIR/$name.pid")" 2>/dev/null || true
            rm -f "$DIR/$name.pid"
        fi
    done
}

start() {
    if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
        if [ "${1:-}" != "--install" ]; then
            echo "slurm-wlm / munge not installed (run with --install, as root)" >&2
            exit 3
        fi
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge \
            >"$DIR.install.log" 2>&1 || { echo "apt-get install slurm-wlm failed, see $DIR.install.log" >&2; exit 3; }
    fi
    stop
    mkdir -p "$DIR/state" "$DIR/spool" /etc/slurm /run/munge /var/log/munge /var/lib/munge /etc/munge
    [ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    chmod 400 /etc/munge/munge.key
    chown -R root:root /etc/munge /run/munge /var/log/munge /var/lib/munge
    munged --force  # as root: this is a throw-away single-machine cluster
    pgrep -nx munged >"$DIR/munged.pid"
    local cpus
    cpus="$(nproc)"
    cat >"$CONF" <<EOF
ClusterName=headrace
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
NodeName=localhost CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
    slurmctld
    slurmd
    for _ in $(seq 60); do
        if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
            echo "slurm up: $(sinfo -h -o '%P %D %T %C')"
            return 0
        fi
        sleep 1
    done
    echo "slurm did not come up, see $DIR/slurmctld.log and $DIR/slurmd.log" >&2
    exit 4
}

case "${1:-}" in
    start) shift; mkdir -p "$DIR"; start "$@" ;;
    stop) stop ;;
    *) echo "usage: $0 start [--install] | stop" >&2; exit 2 ;;
esac
