#!/bin/sh
# Reward 1 when the mean tool, found through the image's PATH, is right.
mkdir -p /logs/verifier
if [ "$(command -v mean)" = /opt/tools/bin/mean ] && [ "$(echo 1 2 3 6 | mean)" = 3.0 ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
