#!/bin/sh
# Reward 1 when the report, read with the iniconfig package the image installed, is right.
mkdir -p /logs/verifier
if python3 - <<'PY'
import iniconfig
summary = iniconfig.IniConfig("/srv/logs/report.ini")["summary"]
assert (summary["requests"], summary["clients"], summary["busiest"]) == ("6", "4", "/index.html")
PY
then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
