#!/bin/sh
set -e
linecount < /app/input.txt > /app/count.txt
greet world > /app/greeting.txt
