#!/usr/bin/env bash
# Runs the job's training step so that SLURM's time-limit warning stops, checkpoints and requeues
# the job, from this one place and once per warning:
#   #SBATCH --signal=B:USR1@180        # the warning comes to the batch shell only
#   #SBATCH --requeue
#   exec examples/slurm/requeue_on_warning.sh srun ... train.py ...
# On the warning, the step gets SIGTERM (torchrun forwards TERM to its workers, not USR1):
# every rank stops at the same step, the checkpoint is written, train.py exits 75. Then the job
# is requeued (`scontrol requeue`): it comes back with the same job id, hence the same run_dir,
# and resume=auto continues it. A step that ended by itself (finished, or failed: exit 2 is a
# user error) is never requeued, nor a job already requeued MAX_REQUEUES times (default 3).
set -uo pipefail
max_requeues=${MAX_REQUEUES:-3}
restarts=${SLURM_RESTART_COUNT:-0}
warned=0

log() { echo "[requeue_on_warning $(date +%H:%M:%S)] $*"; }

on_warning() {
    warned=1
    log "time-limit warning (SIGUSR1): asking the training to checkpoint and stop (SIGTERM)"
    scancel --signal=TERM "$SLURM_JOB_ID"  # the job's steps, not this shell
}
trap on_warning USR1

"$@" &
step=$!
# bash runs a trap only between commands: `wait` returns early when one runs, so wait again.
wait "$step"
rc=$?
while kill -0 "$step" 2>/dev/null; do
    wait "$step"
    rc=$?
done

if ((warned == 0)); then
    exit "$rc"
fi
if ((rc == 0 || rc == 2)); then
    log "the training ended with exit $rc before it could stop; not requeued"
elif ((restarts >= max_requeues)); then
    log "not requeued: the job was requeued $restarts times already (MAX_REQUEUES=$max_requeues)"
else
    log "the training stopped (exit $rc); requeueing job $SLURM_JOB_ID ($((restarts + 1)) of $max_requeues)"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$rc"
