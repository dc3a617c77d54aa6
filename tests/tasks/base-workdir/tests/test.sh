#!/bin/sh
# Reward 1 when the sum is in /app, the base image's WORKDIR, and its tools are there.
mkdir -p /logs/verifier
if [ "$(cat /app/total.txt 2>/dev/null)" = 50 ] && [ "$(pwd)" = /app ] \
    && command -v tmux > /dev/null && command -v asciinema > /dev/null; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
