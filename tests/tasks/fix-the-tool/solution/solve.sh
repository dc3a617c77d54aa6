#!/bin/sh
set -e
sed -i 's/(len(numbers) + 1)/len(numbers)/' "$(command -v mean)"
