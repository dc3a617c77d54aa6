#!/bin/sh
# Reward 1 when /app/pow.txt holds the smallest n (found offline by brute force).
mkdir -p /logs/verifier
if [ "$(tr -d '[:space:]' < /app/pow.txt 2>/dev/null)" = "20518140" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
