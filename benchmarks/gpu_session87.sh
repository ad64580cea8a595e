#!/usr/bin/env bash
# Session 19, call D, for the 4-GPU machine (nvidia-h200-x4). ~5 min.
# Issue 6's ten shapes as shipped (schedule=None), on a fresh machine, with
# the session-19 flagged changes (the arm's rank, one copy queue).
exec bash "$(dirname "$0")/ten_shapes.sh" r87 s19d
