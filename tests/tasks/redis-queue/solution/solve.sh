#!/bin/sh
service redis-server restart
cat > /app/worker.sh <<'SH'
#!/bin/sh
while :; do
    job=$(redis-cli --raw BRPOP jobs 0 | tail -n 1)
    [ -n "$job" ] && redis-cli HSET results "$job" "$(printf %s "$job" | tr a-z A-Z)" > /dev/null
done
SH
nohup sh /app/worker.sh > /app/worker.log 2>&1 &
