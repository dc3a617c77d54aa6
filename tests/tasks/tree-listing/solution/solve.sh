#!/bin/sh
cd /data && tree project > listing.txt
