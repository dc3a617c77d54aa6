#!/bin/sh
curl -sf http://127.0.0.1:8081/token > /app/token.txt
