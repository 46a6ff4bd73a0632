#!/usr/bin/env bash
# Installs the services and tools the test suite runs for real (the project's own files install every
# dependency; CI starts from a clean clone): Prometheus and promtool from Debian's packages, headless
# Chromium, in which tests/test_report_browser.py renders the HTML reports, and Slurm (slurm-wlm:
# slurmctld, slurmd, scontrol), which tests/test_service_actions_slurm.py starts on loopback.
set -euo pipefail
need=()
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
# slurmctld and slurmd live in /usr/sbin, which a non-login PATH may lack
{ command -v slurmctld || test -x /usr/sbin/slurmctld; } >/dev/null 2>&1 || need+=(slurm-wlm)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "tests/setup.sh: installing ${need[*]} from Debian's packages"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  else
    echo "tests/setup.sh: ${need[*]} missing and cannot be installed here; the tests that need them will fail" >&2
  fi
fi
