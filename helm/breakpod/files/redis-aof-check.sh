# Run before every start of Redis (a container restart too), then exec "$@".
#
# A kill while Redis wrote a MULTI/EXEC block leaves half of it at the AOF's end,
# and Redis would replay that half inside later writes: an AOF that stops inside
# a command or a transaction is cut back to before it. Damage further in is left
# to Redis (cutting there would drop every write after it). See docs/broker.md;
# the broker's embedded Redis decides alike (redis_server.repair_aof).
# Redis 7 keeps a manifest in appendonlydir/; Redis 6.2 one appendonly.aof.

ends_damaged() {  # $1: redis-check-aof's report
  case "$1" in
    *"Reached EOF before reading EXEC"*|*"Expected to read"*) return 0 ;;
    *"Expected \\r\\n"*|*"Expected prefix"*) ;;  # a broken line: at the end only?
    *) return 1 ;;
  esac
  # The offset, and the size= of the file it points into (Redis 6.2's one file, or
  # the file of a Redis 7 manifest that failed), given after it.
  at=$(printf '%s\n' "$1" | sed -n 's/^0x *\([0-9a-fA-F][0-9a-fA-F]*\):.*/\1/p' | head -n 1)
  size=$(printf '%s\n' "$1" | sed -n '/^0x/,$ s/^AOF analyzed: .*size=\([0-9][0-9]*\),.*/\1/p' | head -n 1)
  [ -n "$at" ] && [ -n "$size" ] && [ $((0x$at)) -gt 0 ] &&
    [ $((size - 0x$at)) -ge 0 ] && [ $((size - 0x$at)) -le 64 ]
}

for aof in /data/appendonlydir/appendonly.aof.manifest /data/appendonly.aof; do
  [ -s "$aof" ] || continue  # none yet, or empty: nothing to check
  if ! command -v redis-check-aof >/dev/null; then
    echo "redis-check-aof not found: the AOF was not checked"
  elif ! report=$(redis-check-aof "$aof" 2>&1); then
    if ends_damaged "$report"; then
      echo y | redis-check-aof --fix "$aof"
    else
      printf 'AOF damaged before its end, left to redis-server: %s\n' "$report"
    fi
  fi
  break
done
exec "$@"
