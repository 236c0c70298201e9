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
