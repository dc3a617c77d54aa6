#!/bin/sh
set -e
mkdir -p /app/calc
: > /app/calc/__init__.py
cat > /app/calc/ops.py <<'PY'
def add(a, b):
    return a + b


def mul(a, b):
    return a * b
PY
cat > /app/calc/__main__.py <<'PY'
import sys

from calc.ops import add, mul

op, a, b = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
print({"add": add, "mul": mul}[op](a, b))
PY
