#!/usr/bin/env bash
# One GPU session's checks, in the order they matter: the CUDA tests, then the five benchmarks, each with a
# time cap and its own log in $OUT (default ./benchmark-logs); 550 s of caps in all, under one 600 s command.
# Runs from a source tree (no install needed):
#     bash benchmarks/gpu_check.sh
set -u
out=${OUT:-benchmark-logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } 2>&1 | tee "$out/env.txt"
step() {  # name, time cap in seconds, command...
  local name=$1 cap=$2
  shift 2
  echo "== $name (cap ${cap}s)"
  timeout "$cap" "$@" 2>&1 | tee "$out/$name.txt"
}
step tests "${CAP_TESTS:-90}" $py -m pytest -q -o addopts="-ra" -p no:cacheprovider \
  tests/test_cuda.py tests/test_aggregators.py tests/test_attacks.py
step grid "${CAP_GRID:-120}" $py benchmarks/grid.py --no-cpu
step training "${CAP_TRAINING:-180}" $py benchmarks/training.py
step aggregators "${CAP_AGGREGATORS:-70}" $py benchmarks/aggregators.py
step attacks "${CAP_ATTACKS:-60}" $py benchmarks/attacks.py
step data "${CAP_DATA:-30}" $py benchmarks/data.py
