# shellcheck shell=bash
# A real Azure Blob Storage API for the delivery tests: azurite (npm, pinned, installed into
# ./data/tools/azurite), in memory, on EXPORTD_AZURE_PORT (default 43750). ensure_azurite starts
# it, creates the partner's container with a Shared Key signed request, and exports
# EXPORTD_TEST_AZURE_* for the tests; stop_azurite stops it.

AZURITE_VERSION=3.35.0
# azurite's well-known development account (documented by Microsoft; not a secret).
AZURE_ACCOUNT=devstoreaccount1
AZURE_KEY="Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
AZURE_CONTAINER=partner-landing

ensure_azurite() {
  local tools=data/tools/azurite port="${EXPORTD_AZURE_PORT:-43750}" host="${EXPORTD_S3_HOST:-127.0.0.1}"
  if [ ! -x "$tools/node_modules/.bin/azurite-blob" ] ||
    ! grep -q "\"version\": \"$AZURITE_VERSION\"" "$tools/node_modules/azurite/package.json"; then
    echo "installing azurite $AZURITE_VERSION into $tools"
    npm install --silent --no-audit --no-fund --prefix "$tools" "azurite@$AZURITE_VERSION" || return 1
  fi
  local endpoint="http://$host:$port/$AZURE_ACCOUNT"
  if curl -s -o /dev/null "http://$host:$port/"; then
    echo "port $port is taken: stop what listens there or set EXPORTD_AZURE_PORT" >&2
    return 1
  fi
  # Its log goes to ./data/azurite; its blobs stay in memory (the debug log, if any, would too).
  mkdir -p data/azurite
  echo "starting azurite (Blob API on $endpoint)"
  setsid "$tools/node_modules/.bin/azurite-blob" --blobHost "$host" --blobPort "$port" --inMemoryPersistence \
    --disableTelemetry --skipApiVersionCheck >data/azurite/azurite.log 2>&1 &
  AZURITE_PID=$!
  local i
  for i in $(seq 1 60); do
    if python3 scripts/lib/azure-container.py "$endpoint" "$AZURE_ACCOUNT" "$AZURE_KEY" "$AZURE_CONTAINER" 2>/dev/null; then
      echo "azurite ready after $((i / 2)) s"
      export EXPORTD_TEST_AZURE_ENDPOINT="$endpoint" EXPORTD_TEST_AZURE_CONTAINER="$AZURE_CONTAINER"
      export EXPORTD_TEST_AZURE_ACCOUNT="$AZURE_ACCOUNT" EXPORTD_TEST_AZURE_ACCESS_KEY="$AZURE_KEY"
      return 0
    fi
    if ! kill -0 "$AZURITE_PID" 2>/dev/null; then break; fi
    sleep 0.5
  done
  echo "azurite did not become ready; its log:" >&2
  tail -n 30 data/azurite/azurite.log >&2
  stop_azurite
  return 1
}

stop_azurite() {
  local pid="${AZURITE_PID:-}"
  if [ -n "$pid" ]; then
    kill -TERM -- "-$pid" 2>/dev/null || true
    local i
    for i in $(seq 1 25); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  fi
  AZURITE_PID=""
  return 0
}
