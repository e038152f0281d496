# Run before every start of Redis (a container restart too), then exec "$@".
#
# A kill while Redis wrote a MULTI/EXEC block leaves half of it at the AOF's end,
# and Redis would replay that half inside later writes: an AOF that stops inside
# a command or a transaction is cut back to before it. Damage further in is left
# to Redis (cutting there would drop every write after it). See docs/broker.md;
# the broker's embedded Redis decides alike (redis_server.repair_aof).
# Redis 7 keeps a manifest in appendonlydir/; Redis 6.2 one appendonly.aof.

ends_damaged() {  # $1: the AOF, $2: redis-check-aof's report
  case "$2" in
    *"Reached EOF before reading EXEC"*|*"Expected to read"*) return 0 ;;
    *"Expected \\r\\n"*|*"Expected prefix"*) ;;  # a broken line: at the end only?
    *) return 1 ;;
  esac
  # The offset is into the file checked: Redis 6.2's one file (a manifest's is not).
  [ "${1##*/}" = appendonly.aof ] || return 1
  at=$(printf '%s\n' "$2" | sed -n 's/^0x *\([0-9a-fA-F][0-9a-fA-F]*\):.*/\1/p' | head -n 1)
  [ -n "$at" ] && [ $((0x$at)) -gt 0 ] && [ $(($(wc -c < "$1") - 0x$at)) -le 64 ]
}

for aof in /data/appendonlydir/appendonly.aof.manifest /data/appendonly.aof; do
  [ -s "$aof" ] || continue  # none yet, or empty: nothing to check
  if ! command -v redis-check-aof >/dev/null; then
    echo "redis-check-aof not found: the AOF was not checked"
  elif ! report=$(redis-check-aof "$aof" 2>&1); then
    if ends_damaged "$aof" "$report"; then
      echo y | redis-check-aof --fix "$aof"
    else
      echo "AOF damaged before its end, left to redis-server: $report"
    fi
  fi
  break
done
exec "$@"
