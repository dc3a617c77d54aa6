#!/bin/sh
# Reward 1 when both tools did their work: the compiled one copied from the build stage
# and the script a here-document wrote.
mkdir -p /logs/verifier
if [ "$(cat /app/count.txt)" = 3 ] && [ "$(cat /app/greeting.txt)" = "hello world" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
