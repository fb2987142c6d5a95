#!/usr/bin/env bash
# The worker pattern with nothing but curl (and python3 for the SQLite claim).
#   GATEWAY=http://127.0.0.1:8080 DB=jobs.sqlite ./examples/curl_flow.sh r
# Claim → register the attempt as the generation → fenced effect → conditional commit.
set -euo pipefail
GATEWAY=${GATEWAY:-http://127.0.0.1:8080}
DB=${DB:-jobs.sqlite}
JOB=${1:-r}
AUTH=()
[ -n "${FENCEGATE_API_KEY:-}" ] && AUTH=(-H "Authorization: Bearer $FENCEGATE_API_KEY")

sql() { python3 -c 'import sqlite3,sys; c=sqlite3.connect(sys.argv[1], isolation_level=None); r=c.execute(sys.argv[2], sys.argv[3:]).fetchone(); print(r[0] if r else "")' "$DB" "$@"; }

sql "CREATE TABLE IF NOT EXISTS jobs (job_id TEXT PRIMARY KEY, attempt INTEGER NOT NULL DEFAULT 0, state TEXT NOT NULL DEFAULT 'queued')" >/dev/null
sql "INSERT OR IGNORE INTO jobs (job_id) VALUES (?) RETURNING job_id" "$JOB" >/dev/null

# 1. atomic claim: the new attempt number is the fencing token
ATTEMPT=$(sql "UPDATE jobs SET attempt = attempt + 1, state = 'running' WHERE job_id = ? AND state != 'succeeded' RETURNING attempt" "$JOB")
[ -n "$ATTEMPT" ] || { echo "nothing to claim"; exit 0; }
echo "claimed $JOB as generation $ATTEMPT"

# 2. register it, so any older worker is refused from now on
curl -sf "${AUTH[@]}" -XPOST "$GATEWAY/v1/jobs/$JOB/generations" -H 'Content-Type: application/json' \
     -d "{\"generation\": $ATTEMPT, \"lease_ms\": 60000}" >/dev/null

# 3. the side effect, fenced; keyed $JOB:notify on every attempt
STATUS=$(curl -s -o /dev/stderr -w '%{http_code}' "${AUTH[@]}" -XPOST "$GATEWAY/v1/jobs/$JOB/effects/notify" \
     -H "Fencing-Token: $ATTEMPT" -H 'Content-Type: application/json' \
     -d '{"adapter": "hook", "operation": "order.shipped", "payload": {"message": "your order shipped"}}')
echo
case "$STATUS" in
  200) ;;
  409|422) echo "refused ($STATUS): stop working on $JOB"; exit 3 ;;
  *) echo "effect failed ($STATUS)"; exit 1 ;;
esac

# 4. commit only if the attempt is still ours
ROWS=$(sql "UPDATE jobs SET state = 'succeeded' WHERE job_id = ? AND attempt = ? RETURNING 1" "$JOB" "$ATTEMPT")
[ "$ROWS" = "1" ] && echo "done" || echo "lost the job before commit: discarded"
