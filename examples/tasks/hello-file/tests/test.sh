#!/bin/sh
# Reward 1 when /app/greeting.txt holds exactly the expected line.
mkdir -p /logs/verifier
if printf 'Hello from wmo_trio\n' | cmp -s - /app/greeting.txt; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
