#!/bin/sh
# Reward 1 when check-config passes and the files kept their owner and mode.
mkdir -p /logs/verifier
if [ "$(check-config)" = ok ] && [ "$(stat -c '%U:%G %a' /etc/svc/server.conf)" = "svc:svc 640" ] \
    && [ "$(stat -c '%U %a' /etc/svc/logging.conf)" = "svc 640" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
