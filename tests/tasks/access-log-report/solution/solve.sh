#!/bin/sh
set -e
cd /srv/logs
requests=$(wc -l < access.log)
clients=$(cut -d' ' -f1 access.log | sort -u | wc -l)
busiest=$(cut -d'"' -f2 access.log | cut -d' ' -f2 | sort | uniq -c | sort -rn | head -n1 | awk '{print $2}')
printf '[summary]\nrequests = %s\nclients = %s\nbusiest = %s\n' "$requests" "$clients" "$busiest" > report.ini
