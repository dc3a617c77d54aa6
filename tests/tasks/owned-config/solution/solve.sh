#!/bin/sh
set -e
sed -i 's/^port = .*/port = 8080/' "$SVC_CONFIG_DIR/server.conf"
check-config
