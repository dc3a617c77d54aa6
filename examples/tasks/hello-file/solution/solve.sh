#!/bin/sh
printf 'Hello from wmo_trio\n' > /app/greeting.txt
