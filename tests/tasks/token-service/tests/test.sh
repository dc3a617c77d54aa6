#!/bin/sh
# Reward 1 when /app/token.txt holds the token of this trial's own service.
mkdir -p /logs/verifier
if [ -s /run/service-token ] && cmp -s /run/service-token /app/token.txt; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
