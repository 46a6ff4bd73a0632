#!/usr/bin/env bash
# The checks that need a GPU, as one short script for a lent GPU machine (the `device` tool's `run`:
# command `bash tests/device/run.sh`, carry [".whl"], timeout 600). CI has no GPU; these run only there.
#
# 1. nvidia-smi -q: the driver, the GPU, its clocks and ECC state, for the record.
# 2. The NVML collector on the real NVML: one sweep (`foreshock collect --once --sources nvml`), the
#    rows it wrote, one sweep of every real source, 50 timed NVML sweeps (without and with per-link
#    NVLink counters; which gpu columns the GPU supports), and tests/test_collectors_nvml.py (its
#    real-NVML cases run where NVML answers).
# 3. The migrator's NCCL path: tests/test_migrator_fsdp.py, whose NCCL case (bind the device, form a
#    world, ncclCommAbort, form again) skips without CUDA. One GPU allows one NCCL rank only.
#
# The device image has Python 3.12 with torch, pyarrow, grpcio, protobuf, nvidia-ml-py, scikit-learn
# and pytest (../.library/device/KINDS.md); what it lacks travels as wheels in .whl (docs/migrator.md,
# "NCCL"). Everything lands under $OUT: summary.txt first, then each step's output.
set -u
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
PY=${PY:-python3}
summary="$OUT/summary.txt"
: >"$summary"
step() {   # step NAME TIMEOUT_S COMMAND...: run, keep its output, note its exit status
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - t0)) s" | tee -a "$summary"
}
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    step wheels 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/foreshock-site .whl/*.whl
    export PYTHONPATH=/tmp/foreshock-site${PYTHONPATH:+:$PYTHONPATH}
fi
step install 180 "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e .
step nvidia-smi 60 nvidia-smi -q
step collect 120 "$PY" -m foreshock.cli collect --once --sources nvml --node device --out /tmp/foreshock-collect
step collect-rows 60 "$PY" -c "
from foreshock import dataset
for t in ('gpu', 'nvlink', 'nvlink_link'):
    try:
        tab = dataset.read_table('/tmp/foreshock-collect', t)
    except Exception as exc:
        print(t, 'unreadable:', exc); continue
    print(t, tab.num_rows, 'rows;', tab.slice(0, 2).to_pylist())
"
step collect-all 120 "$PY" -m foreshock.cli collect --once --sources nvml,rdma,netdev,host_net,kmsg,systemd \
    --nvlink-links --node device --out /tmp/foreshock-collect-all
step nvml-sweeps 120 "$PY" -c "
import statistics, time
from foreshock.collectors.nvml import NvmlSource
for links in (False, True):
    src = NvmlSource('device', nvlink_links=links)
    src.sweep(time.time_ns())                      # first sweep opens NVML and the Xid watcher
    ms = []
    for _ in range(50):
        t0 = time.perf_counter(); tabs = src.sweep(time.time_ns()); ms.append((time.perf_counter() - t0) * 1e3)
    ms.sort()
    print(f'nvlink_links={links}: 50 sweeps, median {statistics.median(ms):.2f} ms, p90 {ms[44]:.2f} ms, max {ms[-1]:.2f} ms;',
          {k: v.num_rows for k, v in tabs.items()}, 'calls:', dict(getattr(src.backend, 'calls', {}) or {}))
    gpu = tabs.get('gpu')
    if gpu is not None and not links:
        row = gpu.to_pylist()[0]
        print('supported (non-null) gpu columns:', sorted(k for k, v in row.items() if v is not None))
        print('unsupported (null) gpu columns:', sorted(k for k, v in row.items() if v is None))
    src.close()
"
step pytest-nvml 180 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_collectors_nvml.py
step pytest-nccl 240 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_migrator_fsdp.py
cat "$summary"
