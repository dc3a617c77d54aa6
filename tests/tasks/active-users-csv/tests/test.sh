#!/bin/sh
# Reward 1 when the CSV is right and was written by the image's user, in its home.
mkdir -p /logs/verifier
expected='id,name,email
1,Ada,ada@example.org
3,Chen,chen@example.org'
file=/home/analyst/work/active.csv
if [ "$(cat "$file" 2>/dev/null)" = "$expected" ] && [ "$(stat -c %U "$file")" = analyst ] \
    && [ "$(id -un)" = analyst ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
