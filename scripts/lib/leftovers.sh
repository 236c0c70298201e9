# shellcheck shell=bash
# What a run of scripts/test may leave behind outside ./data and ./target: databases and the
# `_sqlx_test` bookkeeping schema on the PostgreSQL server, private clusters in the temporary
# directory, programs installed into ~/.cargo/bin, exportd and SeaweedFS processes. scripts/test
# notes them before the run and fails a green run that left any new one (a failed run keeps its
# test databases on purpose: sqlx keeps them for a look).

# Prints one line per thing outside the clone that a run could create.
leftovers_outside() {
  local tmp="${TMPDIR:-/tmp}"
  ls -d "$tmp"/exportd-pg.* /var/tmp/exportd-pg-* 2>/dev/null | sed 's/^/cluster /' || true
  ls "${CARGO_HOME:-$HOME/.cargo}/bin" 2>/dev/null | sed 's/^/installed /' || true
  pgrep -a -f '(^|/)(exportd|weed) ' 2>/dev/null | grep -v pgrep | sed -E 's/^[0-9]+ /process /' || true
}

# Prints one line per database and per `_sqlx_test` schema on the server at PG_SERVER_URL.
leftovers_on_server() {
  "$(pg_bindir)/psql" -qAt "$PG_SERVER_URL/postgres" \
    -c "SELECT 'database ' || datname FROM pg_database" \
    -c "SELECT 'schema ' || nspname FROM pg_namespace WHERE nspname LIKE '\\_sqlx%'" 2>/dev/null || true
}

# leftovers_compare BEFORE AFTER: fails, naming them, when AFTER has lines BEFORE had not.
leftovers_compare() {
  local new
  new=$(comm -13 <(sort -u "$1") <(sort -u "$2"))
  if [ -n "$new" ]; then
    echo "scripts/test: the run left these behind:" >&2
    printf '  %s\n' "$new" >&2
    return 1
  fi
  echo "scripts/test: nothing left behind outside ./data and ./target"
}
