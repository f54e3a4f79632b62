#!/usr/bin/env bash
# Run one tokenmill job from cron: one run at a time per job spec on this host, its output in a log, its exit code.
#
#   tokenmill-cron.sh JOB.yaml [tokenmill submit options, e.g. --output s3://bucket/jobs/nightly/20260101/]
#
# - `flock -n` on a lock file per spec (TOKENMILL_CRON_LOCK_DIR, default /tmp): while the previous run still holds
#   it, this one logs "skipped" and exits 3 (tokenmill's own code for "another run holds the job") without starting
#   tokenmill. tokenmill's lease (OUTPUT/_lease/) guards the job across hosts as well.
# - Logs append to TOKENMILL_CRON_LOG_DIR (default ~/.local/state/tokenmill)/<spec name>.log: a start line,
#   tokenmill's JSON progress and summary lines, an exit line.
# - Exits with tokenmill's code: 0 done (or nothing to do), 1 failed shards, 2 bad spec or input, 3 held elsewhere,
#   4 cancelled. A rerun resumes a partial job.
set -euo pipefail

if [[ $# -lt 1 || ! -f $1 ]]; then
    echo "usage: $0 JOB.yaml [tokenmill submit options]: the job spec must be a readable file" >&2
    exit 2
fi
job=$1
shift
name=$(basename "$job" .yaml)
lock_dir=${TOKENMILL_CRON_LOCK_DIR:-/tmp}
log_dir=${TOKENMILL_CRON_LOG_DIR:-$HOME/.local/state/tokenmill}
mkdir -p "$lock_dir" "$log_dir"
log="$log_dir/$name.log"
stamp() { date -u +%Y-%m-%dT%H:%M:%SZ; }

exec 9>"$lock_dir/tokenmill-$name.lock"
if ! flock -n 9; then
    echo "$(stamp) skipped: a run of $job still holds $lock_dir/tokenmill-$name.lock" >>"$log"
    exit 3
fi
echo "$(stamp) start: tokenmill submit $job $* (pid $$)" >>"$log"
rc=0
# 9>&-: the lock stays with this script, not with tokenmill's children (Dask worker processes could outlive it).
tokenmill submit "$job" --json "$@" >>"$log" 2>&1 9>&- || rc=$?
echo "$(stamp) exit $rc" >>"$log"
exit "$rc"
