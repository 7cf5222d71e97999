#!/usr/bin/env bash
# Smoke test of the real stack: `infergate up` (its own Redis, a gateway, a
# dispatcher, simulated workers) on a free port, then one synchronous
# inference, one async job to its result, and GET /v1/status with the admin
# key; then a clean stop (SIGTERM, `up` must exit 0 and leave no child).
#
#   bash smoke.sh [VENV]      # VENV: a venv with infergate installed (default .venv)
#
# Every wait is bounded; the stack is stopped on any exit (trap). Needs only
# bash, ps and the venv's python (HTTP checks use urllib: no curl, no jq).
# Exit 0: all checks passed. Prints the up log on failure.
set -euo pipefail

VENV=${1:-${VENV:-.venv}}
PY="$VENV/bin/python"
IG="$VENV/bin/infergate"
READY_S=${SMOKE_READY_S:-60}     # bound on the stack coming up
STOP_S=${SMOKE_STOP_S:-40}       # bound on a clean stop (up's own child bound is 25 s)
WORKERS=${SMOKE_WORKERS:-2}

[[ -x "$PY" && -x "$IG" ]] || { echo "smoke: no infergate in $VENV" >&2; exit 2; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/infergate-smoke.XXXXXX")
LOG="$WORK/up.log"
KEYS="$WORK/keys.json"
UP_PID=""

# A free port on 127.0.0.1 (the gateway binds with SO_REUSEPORT, so a port
# someone else holds the same way would be shared: never reuse a fixed one).
PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
BASE="http://127.0.0.1:$PORT"

children_of() { ps -o pid= --ppid "$1" 2>/dev/null | tr -d ' ' || true; }

stop_stack() {
  # SIGTERM to `up` (it stops its children and its Redis), bounded; then
  # SIGKILL to whatever is left, `up`'s children first (they run in their
  # own sessions, so a process-group kill would miss them).
  [[ -n "$UP_PID" ]] || return 0
  local pid=$UP_PID kids code=0
  UP_PID=""
  kids=$(children_of "$pid")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + STOP_S))
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
  fi
  if kill -0 "$pid" 2>/dev/null; then
    echo "smoke: up did not stop within ${STOP_S}s; killing it and its children" >&2
    kids="$kids $(children_of "$pid")"
    for k in $kids; do kill -KILL "$k" 2>/dev/null || true; done
    kill -KILL "$pid" 2>/dev/null || true
    code=1
  fi
  wait "$pid" 2>/dev/null || code=$?
  for k in $kids; do  # a child `up` started must be gone once it has exited
    if kill -0 "$k" 2>/dev/null; then
      echo "smoke: child $k outlived up; killing it" >&2
      kill -KILL "$k" 2>/dev/null || true
      code=1
    fi
  done
  return "$code"
}

on_exit() {
  local rc=$?
  stop_stack || true
  if ((rc != 0)); then
    echo "smoke: FAILED (exit $rc); up log (demo keys left out):" >&2
    grep -v ' ig-' "$LOG" 2>/dev/null | tail -n 60 >&2 || true
  fi
  rm -rf "$WORK"
  exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT TERM

# Its own Redis (REDIS_URL would make `up` use another one) and namespace.
env -u REDIS_URL "$IG" up --host 127.0.0.1 --port "$PORT" --workers "$WORKERS" \
  --sim-latency-ms 20 --namespace "smoke$$" --keys-out "$KEYS" >"$LOG" 2>&1 &
UP_PID=$!

deadline=$((SECONDS + READY_S))
until "$PY" - "$BASE/readyz" <<'EOF' 2>/dev/null
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=1) as r:
    sys.exit(0 if r.status == 200 else 1)
EOF
do
  kill -0 "$UP_PID" 2>/dev/null || { echo "smoke: up exited before ready" >&2; exit 1; }
  ((SECONDS < deadline)) || { echo "smoke: not ready within ${READY_S}s" >&2; exit 1; }
  sleep 0.3
done
echo "smoke: stack ready on $BASE"

"$PY" - "$BASE" "$KEYS" "$WORKERS" <<'EOF'
import json, sys, time, urllib.error, urllib.request

base, keys_path, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
keys = json.load(open(keys_path))
admin, paid = keys["enterprise"], keys["paid"]  # the demo policy's admin is enterprise


def call(method, path, key, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method)
    req.add_header("Authorization", f"Bearer {key}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read() or b"null")


def check(cond, what, got):
    if not cond:
        sys.exit(f"smoke: {what}: got {got!r}")


# 1. synchronous inference (served by the edge's fast route)
st, hdr, body = call("POST", "/v1/inference", paid, {"input": "hello smoke"})
check(st == 200, "POST /v1/inference status", (st, body))
check(body.get("output", "").endswith("hello smoke"), "inference output", body)
check(body.get("tier") == "paid" and body.get("served_by") == "model", "inference fields", body)
check("x-request-id" in {k.lower() for k in hdr}, "x-request-id header", hdr)
# ...and the one error shape for a bad body
st, _, body = call("POST", "/v1/inference", paid, {"input": ""})
check(st == 400 and body["error"]["code"] == "INVALID_INPUT", "empty input refused", (st, body))
print("smoke: inference ok")

# 2. an async job, to its result
st, hdr, body = call("POST", "/v1/jobs", paid, {"input": "job smoke"})
check(st == 202 and body.get("status") == "queued", "POST /v1/jobs", (st, body))
job = body["job_id"]
check(body.get("location") == f"/v1/jobs/{job}", "job location", body)
deadline = time.monotonic() + 30
while True:
    st, _, body = call("GET", f"/v1/jobs/{job}?wait_s=5", paid)
    check(st == 200, "GET /v1/jobs/{id}", (st, body))
    if body["status"] not in ("queued", "running") or time.monotonic() > deadline:
        break
check(body["status"] == "succeeded", "job status", body)
check(body["result"]["output"].endswith("job smoke"), "job result", body)
st, _, body = call("GET", f"/v1/jobs/{job}", admin)  # another key never sees it
check(st == 404, "job seen by another key", (st, body))
print("smoke: job ok")

# 3. status, with the admin key only
st, _, body = call("GET", "/v1/status", admin)
check(st == 200, "GET /v1/status", (st, body))
check(body["workers_alive"] == workers, "workers_alive", body)
check(body["dispatchers_alive"] == 1 and body["gateways_alive"] == 1, "fleet", body)
check(body["requests_batched"] >= 2, "requests_batched", body)
st, _, body = call("GET", "/v1/status", paid)
check(st == 403 and body["error"]["code"] == "FORBIDDEN", "status without admin", (st, body))
print("smoke: status ok")
EOF

stop_stack || { echo "smoke: the stack did not stop cleanly" >&2; exit 1; }
echo "smoke: stopped cleanly; all checks passed"
