#!/bin/sh
# Reward 1 when Redis answers and the worker upper-cases the jobs the test pushes. Each
# wait ends well inside the verifier's budget (a start on a busy machine may be slow).
mkdir -p /logs/verifier
cd /logs/verifier
until_true() {
    end=$(( $(date +%s) + 60 ))
    while [ "$(date +%s)" -lt "$end" ]; do
        "$@" > /dev/null 2>&1 && return
        sleep 0.2
    done
    return 1
}
three() { [ "$(redis-cli HLEN results)" = 3 ]; }
if ! until_true redis-cli ping; then
    echo "redis does not answer" > checks.txt
    echo 0 > reward.txt
    exit 0
fi
redis-cli DEL results > /dev/null
redis-cli LPUSH jobs alpha beta gamma > /dev/null
until_true three || echo "the worker did not process the jobs" > checks.txt
if three && [ "$(redis-cli --raw HGET results beta)" = BETA ]; then
    echo 1 > reward.txt
else
    redis-cli HGETALL results >> checks.txt
    echo 0 > reward.txt
fi
