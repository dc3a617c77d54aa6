#!/bin/sh
# Reward 1 when the package has its three files and its command line computes correctly.
mkdir -p /logs/verifier
fail() { echo "$1" >&2; echo 0 > /logs/verifier/reward.txt; exit 0; }
cd /app || fail "no /app"
for f in calc/__init__.py calc/ops.py calc/__main__.py; do
    [ -f "$f" ] || fail "missing $f"
done
[ "$(python3 -m calc add 2 3)" = "5" ] || fail "add 2 3 is not 5"
[ "$(python3 -m calc mul 4 5)" = "20" ] || fail "mul 4 5 is not 20"
[ "$(python3 -m calc add -7 12)" = "5" ] || fail "add -7 12 is not 5"
python3 -c 'from calc.ops import add, mul; assert add(20, 22) == 42 and mul(6, 7) == 42' \
    || fail "calc.ops is wrong"
echo 1 > /logs/verifier/reward.txt
