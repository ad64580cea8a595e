#!/usr/bin/env bash
# Session 17, call B, on call A's machine right after it (the install is
# kept): the flagged and Pallas-compute GPU tests, among them the timeout
# test whose message pattern session 16 widened.
set -u
source "$(dirname "$0")/gpu_env.sh"
R=/tmp/r70b; rm -rf "$R"; mkdir -p "$R"
python3 -c "import ficco_jax" 2>/dev/null || { t install; python3 -m pip install --no-build-isolation --no-deps . > /tmp/install.log 2>&1; }
t tests
(cd /tmp && timeout 200 python3 -P -m pytest -q "$OLDPWD/tests/test_dma_protocol.py" "$OLDPWD/tests/test_ops.py" -k "flagged or pallas_compute" \
  > "$R/pytest_flagged.txt" 2>&1); echo "pytest rc=$?"; tail -3 "$R/pytest_flagged.txt"
tar czf "$OUT/r70b.tgz" -C /tmp r70b; ls -la "$OUT"
t end
