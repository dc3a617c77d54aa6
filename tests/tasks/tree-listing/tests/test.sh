#!/bin/sh
# Reward 1 when the listing matches what the image's own tree prints.
mkdir -p /logs/verifier
if command -v tree > /dev/null && [ "$(cd /data && tree project)" = "$(cat /data/listing.txt)" ] \
    && grep -q "main.c" /data/listing.txt; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
