#!/usr/bin/env bash
# Session 20, for the 4-GPU machine (nvidia-h200-x4). ~5 min.
# Issue 6's ten shapes as shipped (schedule=None) but with the flagged
# schedules over the push protocol (FICCO_FLAGGED_TRANSPORT=push).
FICCO_FLAGGED_TRANSPORT=push exec bash "$(dirname "$0")/ten_shapes.sh" r93 s20_push
