#!/bin/sh
# Start the service in the background, then run the container's command.
python3 /opt/service/service.py > /tmp/service.log 2>&1 &
exec "$@"
