#!/bin/bash
# A one-host Slurm cluster on this machine, and both templates run on it under sbatch on CPU (too slow for CI).
#
#   sudo scripts/slurm/test_local_slurm.sh [WORK_DIR]      # as root; default WORK_DIR /tmp/t5zero-slurm
#
# Installs Debian's slurm-wlm and munge (apt-get), writes /etc/slurm/slurm.conf for this host, starts munged,
# slurmctld and slurmd, then: (1) prep-corpus.sbatch (a Ray head via srun) builds a tiny shard set; (2)
# pretrain.sbatch trains t5-tiny on 2 tasks to the end; (3) a longer pretrain job gets SIGUSR1 (as from
# --signal=B:USR1@120) mid-run: its ranks save and exit 75, the job requeues itself and resumes to the end.
# Prints PASS or FAIL per check; exit status 0 only if all pass. Leaves the daemons running (stop: see the end).
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${1:-/tmp/t5zero-slurm}
PYTHON=${T5ZERO_PYTHON:-$REPO/.venv/bin/python}
HOST=$(hostname -s)
CPUS=$(nproc)
MEM_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
failures=0
check() { if eval "$2"; then echo "PASS: $1"; else echo "FAIL: $1"; failures=$((failures + 1)); fi; }

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge
fi
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge "$WORK"
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=t5zero-local
SlurmctldHost=$HOST
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ReturnToService=2
JobRequeue=1
KillWait=30
MpiDefault=none
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=local Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
[ -s /etc/munge/munge.key ] || { mkdir -p /etc/munge; dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null; }
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null; chmod 400 /etc/munge/munge.key
pgrep -x munged >/dev/null || su -s /bin/sh munge -c munged || munged --force
pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd
for _ in $(seq 30); do sinfo -h -o %T 2>/dev/null | grep -qE "idle|mix|alloc" && break; sleep 1; done
sinfo
check "the local cluster is up" 'sinfo -h -o %T | grep -qE "idle|mix|alloc"'

cd "$WORK"
export T5ZERO_PYTHON=$PYTHON T5ZERO_REPO=$REPO TOKENIZERS_PARALLELISM=false
[ -s tok/tokenizer.json ] || PYTHONPATH=$REPO "$PYTHON" -m pipeline.cli tokenizer --input sample --vocab-size 1024 --out tok
rm -rf shards runs slurm-*.out

echo "== 1. prep corpus (Ray head started with srun)"
sbatch --wait --nodes 1 --ntasks 1 --cpus-per-task "$CPUS" "$REPO/scripts/slurm/prep-corpus.sbatch" \
    --input sample --tokenizer tok/tokenizer.json --out shards --input-length 128 --shard-rows 256 --quiet
tail -n 5 slurm-t5zero-prep-*.out
check "prep corpus under sbatch wrote a manifest" '[ -s shards/manifest.json ]'

TRAIN="--model t5-tiny --data shards --micro-batch 4 --global-batch 16 --zero 2 --loader-workers 0"
echo "== 2. pretrain, 2 srun tasks, to the end"
sbatch --wait --nodes 1 --ntasks 2 --cpus-per-task 1 "$REPO/scripts/slurm/pretrain.sbatch" $TRAIN --steps 6 --out runs/plain
tail -n 3 slurm-t5zero-pretrain-*.out
check "pretrain under sbatch ended ok with 2 ranks" \
    'grep -q "\"status\": \"ok\"" runs/plain/summary.json && grep -q "\"world_size\": 2" runs/plain/summary.json'

echo "== 3. pretrain preempted by SIGUSR1, requeued, resumed"
rm -f slurm-t5zero-pretrain-*.out
JOB=$(sbatch --parsable --nodes 1 --ntasks 2 --cpus-per-task 1 "$REPO/scripts/slurm/pretrain.sbatch" $TRAIN \
      --steps 40 --out runs/preempt)
for _ in $(seq 300); do [ "$(cat runs/preempt/metrics.jsonl 2>/dev/null | wc -l)" -ge 5 ] && break; sleep 1; done
scancel --signal=USR1 --batch "$JOB"          # what --signal=B:USR1@120 does before the time limit
for _ in $(seq 600); do squeue -h -j "$JOB" 2>/dev/null | grep -q . || break; sleep 2; done
cat slurm-t5zero-pretrain-"$JOB".out | grep -E "^\[slurm\]|\[preempt\]|\[resume\]|\[done\]"
check "the preempted job saved, exited 75 and requeued itself" 'grep -q "requeueing job $JOB" slurm-t5zero-pretrain-$JOB.out'
check "the requeued job resumed from the checkpoint" 'grep -q "^\[resume\] step-" slurm-t5zero-pretrain-$JOB.out'
check "the requeued job ran to the end" 'grep -q "\"status\": \"ok\"" runs/preempt/summary.json && grep -q "\"steps\": 40" runs/preempt/summary.json'
check "metrics.jsonl has every step once" '[ "$("$PYTHON" -c "import json,sys; print([json.loads(l)[\"step\"] for l in open(sys.argv[1])] == list(range(1, 41)))" runs/preempt/metrics.jsonl)" = True ]'

echo "stop the cluster: scontrol shutdown; kill \$(pgrep -x munged)"
[ "$failures" -eq 0 ] && echo "ALL PASS" || echo "$failures FAILED"
exit "$failures"
