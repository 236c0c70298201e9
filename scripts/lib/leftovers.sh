# shellcheck shell=bash
# What a run of scripts/test may leave behind outside ./data and ./target: databases and the
# `_sqlx_test` bookkeeping schema on the PostgreSQL server, private clusters, SeaweedFS sockets
# and logs in the temporary directory, programs installed into ~/.cargo/bin, exportd and
# SeaweedFS processes. scripts/test
# notes them before the run and fails a green run that left any new one (a failed run keeps its
# test databases on purpose: sqlx keeps them for a look).

# Prints one line per thing outside the clone that a run could create.
leftovers_outside() {
  local tmp="${TMPDIR:-/tmp}"
  ls -d "$tmp"/exportd-pg.* /var/tmp/exportd-pg-* 2>/dev/null | sed 's/^/cluster /' || true
  ls -d "$tmp"/seaweedfs-* "$tmp"/weed.* 2>/dev/null | sed 's/^/temp /' || true
  ls "${CARGO_HOME:-$HOME/.cargo}/bin" 2>/dev/null | sed 's/^/installed /' || true
  pgrep -a -f '(^|/)(exportd|weed) ' 2>/dev/null | grep -v pgrep | sed -E 's/^[0-9]+ /process /' || true
}

# Prints one line per database and per `_sqlx_test` schema on the server at PG_SERVER_URL.
leftovers_on_server() {
  "$(pg_bindir)/psql" -qAt "$PG_SERVER_URL/postgres" \
    -c "SELECT 'database ' || datname FROM pg_database" \
    -c "SELECT 'schema ' || nspname FROM pg_namespace WHERE nspname LIKE '\\_sqlx%'" 2>/dev/null || true
}

# Drops, naming each and its test, the test databases sqlx still has registered after a green
# run: when a test passes sqlx tries once to drop its database, and that fails while a
# connection of the test (a killed child's backend, a closing pool) is still going away.
drop_sqlx_stragglers() {
  local psql=("$(pg_bindir)/psql" -qAt -F ' ' "$DATABASE_URL")
  "${psql[@]}" -c "SELECT db_name, test_path FROM _sqlx_test.databases" 2>/dev/null |
    while read -r name test; do
      echo "scripts/test: sqlx did not drop the database of $test ($name) after it passed; dropping it" >&2
      PGOPTIONS="-c client_min_messages=warning" "${psql[@]}" -c "DROP DATABASE IF EXISTS \"$name\" WITH (FORCE)"
    done
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
