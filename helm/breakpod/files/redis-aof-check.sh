# Run before every start of Redis (a container restart too), then exec "$@".
#
# A kill while Redis wrote a MULTI/EXEC block leaves half of it at the AOF's end,
# and Redis would replay that half inside later writes: an AOF that stops inside
# a command or a transaction is cut back to before it. Damage further in is left
# to Redis (cutting there would drop every write after it). See docs/broker.md.
# Redis 7 keeps a manifest in appendonlydir/; Redis 6.2 one appendonly.aof.
for aof in /data/appendonlydir/appendonly.aof.manifest /data/appendonly.aof; do
  [ -f "$aof" ] || continue
  if ! report=$(redis-check-aof "$aof" 2>&1); then
    case "$report" in
      *"Reached EOF before reading EXEC"*|*"Expected to read"*)
        echo y | redis-check-aof --fix "$aof" ;;
      *) echo "AOF damaged before its end, left to redis-server: $report" ;;
    esac
  fi
  break
done
exec "$@"
