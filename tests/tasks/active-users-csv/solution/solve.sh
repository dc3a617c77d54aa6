#!/bin/sh
set -e
cd "$HOME/work"
python3 -c '
import csv, json, sys
writer = csv.writer(sys.stdout, lineterminator="\n")
writer.writerow(["id", "name", "email"])
for user in json.load(open("users.json")):
    if user["active"]:
        writer.writerow([user["id"], user["name"], user["email"]])
' > active.csv
