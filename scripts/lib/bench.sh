# shellcheck shell=bash
# Helpers of the benchmarks, which report results as multiples of a floor measured in the
# same run (the machine's speed moves; ratios decide).

# Prints how long a command takes, in seconds (its output is discarded).
seconds() {
  local start end
  start=$(date +%s.%N)
  "$@" >/dev/null
  end=$(date +%s.%N)
  awk -v a="$start" -v b="$end" 'BEGIN { printf "%.3f\n", b - a }'
}

median() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

# Runs a command, printing "<seconds> <peak RSS KiB>" (the kernel's count for the largest of its
# processes; its own output goes to stderr). No polling loop: on 2 cores one that forks every
# 50 ms takes CPU from what it measures.
measure() {
  python3 - "$@" <<'PY'
import resource, subprocess, sys, time
start = time.monotonic()
subprocess.run(sys.argv[1:], check=True, stdout=sys.stderr)
took = time.monotonic() - start
print(f"{took:.3f} {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}")
PY
}
