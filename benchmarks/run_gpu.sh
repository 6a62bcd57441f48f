#!/usr/bin/env bash
# GPU tier + benchmark on a 2-GPU host (the `device` tool's nvidia-h200-x2), one command.
# Wheels travel in .whl/ (megatron-core 0.16.1 and 0.19.2 cp312, megatron-bridge 0.3.1 and 0.6.2; for the
# 'real' stage also .whl/real{common,031,062}/, see that stage).
# Results land in $OUT (or benchmarks/results): logs of the GPU tier and eval_sync.{json,png}.
set -uo pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export NO_VCS_VERSION=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
STAGES=${STAGES:-"tier0161 tier0192 exits bench"}
for spec in core0161:megatron_core-0.16.1 core0192:megatron_core-0.19.2 \
            bridge031:megatron_bridge-0.3.1 bridge062:megatron_bridge-0.6.2; do
  dir=/tmp/${spec%%:*}; [ -d "$dir" ] || python3 -m pip install -q --no-index --no-deps --no-compile \
      --target "$dir" .whl/${spec#*:}-*.whl
done
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu_env.txt"
python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())' | tee -a "$OUT/gpu_env.txt"
for stage in $STAGES; do
  case $stage in
    tier0161) PYTHONPATH=/tmp/core0161:/tmp/bridge031:. python3 -m pytest -m gpu -v -p no:cacheprovider \
                tests/gpu/test_gpu_tier.py 2>&1 | tee "$OUT/gpu_tier_core0161.log" ;;
    tier0192) PYTHONPATH=/tmp/core0192:/tmp/bridge062:. MXFP8_BRIDGE_LOOP=0.6.2 python3 -m pytest -m gpu -v \
                -p no:cacheprovider tests/gpu/test_gpu_tier.py 2>&1 | tee "$OUT/gpu_tier_core0192.log" ;;
    exits) for spec in core0161:bridge031: core0192:bridge062:0.5.1 core0192:bridge062:0.6.2; do
             IFS=: read -r core bridge loop <<< "$spec"
             echo "== megatron-core ${core#core}, Bridge loop ${loop:-0.3.1 + 0.4.2}"
             PYTHONPATH=/tmp/$core:/tmp/$bridge:. MXFP8_BRIDGE_LOOP=$loop python3 -m pytest -v -rs \
               -p no:cacheprovider tests/ranks/test_exit_saves.py 2>&1
           done | tee "$OUT/gpu_exit_saves.log" ;;
    real) # Megatron-Bridge's own pretrain() (tests/bridge_real/test_bridge_real.py) on NCCL. Wheels: .whl/realcommon
          # (modelopt + deps, omegaconf), .whl/real031 (Bridge 0.3.1, transformers<5), .whl/real062
          # (Bridge 0.6.2, transformers 5.8.1 + tokenizers 0.22.2: the image's 0.23.2 is refused).
          # REAL_PAIRS picks the pairs (then only their wheel folders need to travel).
          pairs=${REAL_PAIRS:-"core0161:real031 core0192:real062"}
          for d in realcommon $(for p in $pairs; do echo "${p#*:}"; done); do
            [ -d /tmp/$d ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/$d .whl/$d/*.whl
          done
          for spec in $pairs; do
            IFS=: read -r core bridge <<< "$spec"
            echo "== megatron-core ${core#core}, ${bridge}"
            PYTHONPATH=/tmp/$bridge:/tmp/$core:/tmp/realcommon:. MXFP8_REAL_BRIDGE=require python3 -m pytest -v \
              -p no:cacheprovider tests/bridge_real/test_bridge_real.py -k "${REAL_K:-not pipeline}" 2>&1
          done | tee "$OUT/gpu_bridge_real${REAL_LOG:-}.log" ;;
    bench) python3 benchmarks/eval_sync.py run --sizes "${SIZES:-1B,4B}" --nproc "${NPROC:-2}" --out "$OUT" \
                --core 0.16.1=/tmp/core0161:/tmp/bridge031 --core 0.19.2=/tmp/core0192:/tmp/bridge062 \
                2>&1 | grep -v -i warn | tee "$OUT/eval_sync.log" ;;
  esac
done
