#!/bin/sh
# Reward 1 when the server the solution left running answers on port 8765. It is given
# until well inside the verifier's budget to answer (a start on a busy machine).
mkdir -p /logs/verifier
answer=
end=$(( $(date +%s) + 40 ))
while [ "$(date +%s)" -lt "$end" ]; do
    answer=$(python3 -c 'import urllib.request as u; print(u.urlopen("http://127.0.0.1:8765/sum?a=2&b=40", timeout=5).read().decode())' 2>/dev/null) && break
    sleep 0.1
done
echo "answer: $answer" > /logs/verifier/answer.txt
if [ "$answer" = 42 ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
