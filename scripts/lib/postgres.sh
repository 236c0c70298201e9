# shellcheck shell=bash
# Finds a PostgreSQL server for scripts/test and scripts/demo.
#
# ensure_postgres: uses the server named by DATABASE_URL (default postgres://postgres@127.0.0.1:5432)
# when it answers; otherwise starts a private cluster from the installed binaries in ./data/pg on
# port EXPORTD_PG_PORT (default 55433), stopped again when the calling script exits (and removed,
# when the postgres user could not keep it inside the clone: nothing is left outside it).
# Afterwards PG_SERVER_URL holds the server URL without a database name.

pg_bindir() {
  if command -v pg_config >/dev/null 2>&1 && [ -x "$(pg_config --bindir)/initdb" ]; then
    pg_config --bindir
  elif ls -d /usr/lib/postgresql/*/bin >/dev/null 2>&1; then
    ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1
  elif command -v initdb >/dev/null 2>&1; then
    dirname "$(command -v initdb)"
  else
    echo "PostgreSQL (>= 15) is not installed: no initdb found" >&2
    return 1
  fi
}

# Runs a PostgreSQL server binary, as the postgres user when we are root (it refuses root),
# from / (the postgres user may not be allowed into the current directory, e.g. under /root).
pg_run() {
  if [ "$(id -u)" = 0 ]; then (cd / && runuser -u postgres -- "$@"); else "$@"; fi
}

# A database name of this checkout's own (prefix and a hash of its path): two clones running
# their scripts on one server never share, or drop, each other's databases.
checkout_database() { # prefix
  printf '%s_%s' "$1" "$(printf '%s' "$PWD" | sha256sum | cut -c1-8)"
}

# Drops a database of a script that is done with it, so a run leaves nothing behind.
drop_database() { # name
  PGOPTIONS="-c client_min_messages=warning" "$(pg_bindir)/psql" -q "$PG_SERVER_URL/postgres" \
    -c "DROP DATABASE IF EXISTS \"$1\" WITH (FORCE)"
}

pg_answers() { # url
  "$(pg_bindir)/pg_isready" -q -d "$1" -t 3 >/dev/null 2>&1
}

ensure_postgres() {
  local url="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432}"
  # Strip a database name: callers add their own.
  PG_SERVER_URL="$(printf '%s' "$url" | sed -E 's#^(postgres(ql)?://[^/?]*).*#\1#')"
  if pg_answers "$PG_SERVER_URL/postgres"; then
    echo "using PostgreSQL at ${PG_SERVER_URL#*@}"
    return 0
  fi
  local port="${EXPORTD_PG_PORT:-55433}"
  local dir
  dir="$(pwd)/data/pg"
  PG_SERVER_URL="postgres://postgres@127.0.0.1:$port"
  if pg_answers "$PG_SERVER_URL/postgres"; then
    echo "using the private PostgreSQL cluster on port $port"
    return 0
  fi
  echo "no PostgreSQL at ${url#*@}; starting a private cluster in $dir on port $port"
  start_private_postgres "$dir" "$port" 127.0.0.1 || return 1
  trap 'stop_private_postgres' EXIT
}

# start_private_postgres DIR PORT LISTEN_ADDRESSES: initdb (once) and start a cluster in DIR,
# trust auth, listening on PORT at LISTEN_ADDRESSES; PRIVATE_PG_DIR remembers it for
# stop_private_postgres.
start_private_postgres() {
  local dir="$1" port="$2" listen="$3" bin
  bin="$(pg_bindir)"
  mkdir -p "$dir"
  if [ "$(id -u)" = 0 ]; then
    chown postgres:postgres "$dir"
    # A clone under a directory the postgres user cannot enter (/root is mode 700): run the
    # cluster where it can, in a directory of this run's own that stop_private_postgres removes.
    if ! pg_run test -w "$dir"; then
      local elsewhere
      elsewhere="$(mktemp -d "${TMPDIR:-/tmp}/exportd-pg.XXXXXX")"
      echo "the postgres user cannot reach $dir; running this private cluster in $elsewhere until the script ends"
      rmdir "$dir" 2>/dev/null || true
      dir="$elsewhere"
      chown postgres:postgres "$dir" && chmod 700 "$dir"
      PRIVATE_PG_REMOVE=1
    fi
  fi
  if [ ! -f "$dir/data/PG_VERSION" ]; then
    pg_run "$bin/initdb" -D "$dir/data" -U postgres -A trust -E UTF8 --no-locale >"$dir/initdb.log" 2>&1 \
      || { cat "$dir/initdb.log" >&2; return 1; }
    # trust for the test hosts' addresses too (private clusters serve only tests and demos)
    echo "host all all 0.0.0.0/0 trust" | pg_run tee -a "$dir/data/pg_hba.conf" >/dev/null
  fi
  pg_run "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
    -o "-p $port -k $dir -c listen_addresses=$listen -c max_connections=200" start >/dev/null \
    || { cat "$dir/server.log" >&2; return 1; }
  PRIVATE_PG_DIR="$dir"
}

stop_private_postgres() {
  if [ -n "${PRIVATE_PG_DIR:-}" ]; then
    pg_run "$(pg_bindir)/pg_ctl" -D "$PRIVATE_PG_DIR/data" -m fast -w stop >/dev/null 2>&1 || true
    if [ -n "${PRIVATE_PG_REMOVE:-}" ]; then rm -rf "$PRIVATE_PG_DIR"; fi
    PRIVATE_PG_DIR="" PRIVATE_PG_REMOVE=""
  fi
  return 0
}

# start_private_standby PRIMARY_PORT DIR PORT: a hot standby of the private cluster on
# PRIMARY_PORT, made with pg_basebackup -R into DIR and streaming from it on PORT (DIR must be
# one the postgres user can write; stop it with stop_cluster DIR).
start_private_standby() {
  local primary_port="$1" dir="$2" port="$3" bin
  bin="$(pg_bindir)"
  mkdir -p "$dir"
  if [ "$(id -u)" = 0 ]; then chown postgres:postgres "$dir" && chmod 700 "$dir"; fi
  rm -rf "$dir/data"
  pg_run "$bin/pg_basebackup" -D "$dir/data" -h 127.0.0.1 -p "$primary_port" -U postgres -R -X stream -c fast \
    >"$dir/basebackup.log" 2>&1 || { cat "$dir/basebackup.log" >&2; return 1; }
  pg_run "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
    -o "-p $port -k $dir -c listen_addresses=127.0.0.1 -c max_connections=200 -c hot_standby_feedback=on" start >/dev/null \
    || { cat "$dir/server.log" >&2; return 1; }
}

stop_cluster() { # dir
  pg_run "$(pg_bindir)/pg_ctl" -D "$1/data" -m fast -w stop >/dev/null 2>&1 || true
}

# cluster_cpu_seconds DIR: CPU seconds the cluster in DIR has used so far: its postmaster, the
# children alive now and those it has reaped (backends, walsenders, background processes).
cluster_cpu_seconds() {
  local pid ticks=0 f
  pid="$(head -n 1 "$1/data/postmaster.pid")"
  # Fields after the command name: utime, stime, cutime, cstime are the 12th to 15th.
  read -r -a f < <(sed -E 's/^.*\) //' "/proc/$pid/stat")
  ticks=$((f[11] + f[12] + f[13] + f[14]))
  for child in $(pgrep -P "$pid"); do
    read -r -a f < <(sed -E 's/^.*\) //' "/proc/$child/stat" 2>/dev/null) || continue
    if [ "${#f[@]}" -gt 12 ]; then ticks=$((ticks + f[11] + f[12])); fi
  done
  awk -v t="$ticks" -v hz="$(getconf CLK_TCK)" 'BEGIN { printf "%.2f\n", t / hz }'
}
