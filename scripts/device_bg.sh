#!/usr/bin/env bash
# Jobs that outlive one device call: a lease's calls are ≤ 10 min each and the machine goes back after 30 s idle,
# while a process that starts its own session (setsid) runs on until the machine goes back. So a long or parallel
# stage starts here, the lease goes on with other calls (chunk moves, another job), and a later call waits for it:
#   bash scripts/device_bg.sh start NAME [ENV=VALUE …] -- COMMAND …   start NAME in its own session, in this folder
#   bash scripts/device_bg.sh wait SECONDS NAME …                      until every NAME ended or SECONDS passed
#   bash scripts/device_bg.sh show                                     each job: running / rc, last log lines
#   bash scripts/device_bg.sh tree                                     copy this tree (with .git, without .stage and
#                                                                      .whl) to $HOME/tree: start jobs from there, as
#                                                                      a later call re-copies the repository's folder
# Each job: $HOME/bg/NAME.log (stdout + stderr), $HOME/bg/NAME.rc once it ended (its exit status). Jobs that share
# the GPU run side by side: their quality records are what one alone would write, their latencies are not (the
# run set is named in `Table.shared_gpu`, src/report/benchmarks.py, and its COMMANDS.md says so).
set -euo pipefail
BG=$HOME/bg
mkdir -p "$BG"
state() { if [ -e "$BG/$1.rc" ]; then echo "rc $(cat "$BG/$1.rc")"; else echo "$2"; fi; }  # state NAME WHILE-RUNNING
case ${1:-} in
  start)
    name=$2; shift 2
    [ -e "$BG/$name.log" ] && { echo "device_bg: $name already started here (see $BG/$name.log)" >&2; exit 2; }
    : > "$BG/$name.log"
    envs=()
    while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
    [ "${1:-}" = "--" ] || { echo "device_bg: start NAME [ENV=VALUE …] -- COMMAND …" >&2; exit 2; }
    shift
    # the job's exit status lands in NAME.rc whatever ends it (a failed command, a timeout inside it)
    setsid env "${envs[@]}" bash -c '"$@"; echo $? > "'"$BG/$name.rc"'"' job "$@" > "$BG/$name.log" 2>&1 < /dev/null &
    echo "started $name (pid $!)" ;;
  wait)
    limit=$2; shift 2
    deadline=$((SECONDS + limit))
    for name in "$@"; do
      [ -e "$BG/$name.log" ] || { echo "device_bg: $name was never started here" >&2; exit 2; }
      while [ ! -e "$BG/$name.rc" ] && [ "$SECONDS" -lt "$deadline" ]; do sleep 2; done
      echo "$name: $(state "$name" "still running")"
    done ;;
  show)
    for log in "$BG"/*.log; do
      [ -e "$log" ] || continue
      name=$(basename "$log" .log)
      echo "== $name: $(state "$name" running)"
      tail -3 "$log"
    done ;;
  tree)
    if [ "$(pwd -P)" = "$(cd "$HOME" && pwd -P)/tree" ]; then
      echo "device_bg: tree copies the repository's folder, not \$HOME/tree itself" >&2; exit 2
    fi
    rm -rf "$HOME/tree" && mkdir -p "$HOME/tree"
    tar --exclude=./.stage --exclude=./.whl -cf - . | tar -xf - -C "$HOME/tree"
    echo "copied to $HOME/tree ($(du -sh "$HOME/tree" | cut -f1))" ;;
  *) echo "usage: device_bg.sh start NAME [ENV=VALUE …] -- COMMAND … | wait SECONDS NAME … | show | tree" >&2; exit 2 ;;
esac
