#!/usr/bin/env bash
# The GPU checks (run on a machine with a CUDA GPU and its own torch; CI has none): tests/test_cuda.py and the
# distributed runtime's NCCL tests (one rank per GPU: with one GPU, only the one-rank test runs), then
# `fastt run` on two streams of one GPU. Logs go to ${OUT:-out}/. Usage: scripts/gpu_check.sh [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out}"; mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" | tee "$out/gpu.log"
python3 -m pytest -q -p no:cacheprovider -s --durations=8 tests/test_cuda.py tests/test_distributed.py -k \
  "cuda or nccl or gpu" "$@" 2>&1 | tee -a "$out/gpu.log"
rc=${PIPESTATUS[0]}
# Speed on two streams of one GPU (batch-norm models are not --check'ed over a trajectory: see tests/test_cuda.py).
python3 -m fastt.cli run --model bert-base --devices cuda:0,0 --planners fastt,dp,single,eager --steps 20 --check \
  2>&1 | tee -a "$out/gpu.log"
python3 -m fastt.cli run --model inception_v3 --devices cuda:0,0 --planners fastt,dp,single,eager --steps 20 \
  2>&1 | tee -a "$out/gpu.log"
exit "$rc"
