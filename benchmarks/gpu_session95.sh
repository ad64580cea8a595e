#!/usr/bin/env bash
# Session 21, for the 4-GPU machine (nvidia-h200-x4), one lease. ~8.5 min.
# The push protocol at W=4: its tests, host floor and the host-bound pair
# (gpu_session92.sh, two processes), then issue 6's ten shapes as shipped
# but with the flagged schedules over the push protocol (ten_shapes.sh).
# Writes $OUT/r92.tgz and $OUT/r95.tgz.
set -u
D="$(dirname "$0")"
W=4 PAIRS=${PAIRS:-2} bash "$D/gpu_session92.sh"
FICCO_FLAGGED_TRANSPORT=push bash "$D/ten_shapes.sh" r95 s21_push
