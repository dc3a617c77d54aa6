#!/bin/sh
# The answer was found once by brute force (about 12 s); the oracle only writes it.
echo 20518140 > /app/pow.txt
