#!/usr/bin/env bash
# Session 19, call F, for the 4-GPU machine (nvidia-h200-x4). ~5 min.
# Issue 6's ten shapes as shipped (schedule=None), again on a fresh machine (call D's script), with
# the session-19 flagged changes (the arm's rank, one copy queue).
exec bash "$(dirname "$0")/ten_shapes.sh" r89 s19f
