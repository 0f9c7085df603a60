#!/usr/bin/env bash
# The GPU runs behind README's speed tables, batched so that each machine start serves several measurements.
# Usage (repository root): bash benchmarks/h200_runs.sh part1|part2|part3|part6|part9 RESULTS_DIR (two H200s), or
# bash benchmarks/h200_runs.sh part4|part8 RESULTS_DIR BASE_TREE | part5|part7|part10-part20 RESULTS_DIR (one H200;
# BASE_TREE: a copy of the tree before part4's change)
# part1: one GPU (decode on GPU 1 beside training on GPU 0), then Llama 3.2 1B and Llama 3 8B tensor parallel on two.
# part2: decode profiled, and with its layer loop unrolled, then Llama 3 8B tensor parallel and FSDP on two GPUs (cut
# off by the call's time limit).
set -u
export PYTHONUNBUFFERED=1
part=$1; out=$2
mkdir -p "$out"

# with_torch SECONDS SCRIPT ARGS...: python3 SCRIPT ARGS... within SECONDS, torch imported before JAX starts (without
# it the batch-1 decode steps of the process run slow, benchmarks/NOTES.md run 84).
with_torch() {
  timeout "$1" python3 -c "import sys, runpy, torch; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], \
run_name='__main__')" "${@:2}"
}
if [ "$part" = part1 ]; then
  CUDA_VISIBLE_DEVICES=1 python3 scripts/bench_decode.py --model llama3-8b --batches 1 64 --cache 4096 \
    --out "$out/decode_llama3-8b_1gpu.json" > "$out/decode.log" 2>&1 &
  decode=$!
  CUDA_VISIBLE_DEVICES=0 python3 scripts/bench_mfu.py --layouts starscream_tp --unfused --plain dp \
    --profile-dir /tmp/profiles/traces --hlo-dir /tmp/profiles/hlo --out "$out/mfu_llama3.2-1b_1gpu.json"
  wait $decode; cat "$out/decode.log"
  (cd /tmp/profiles && tar czf "$out/profiles.tgz" hlo $(find traces -name perfetto_trace.json.gz))
  python3 scripts/bench_mfu.py --gpus 2 --plain dp tp --layouts starscream_tp starscream_fsdp \
    --out "$out/mfu_llama3.2-1b_2gpu.json"
  python3 scripts/bench_mfu.py --model llama3-8b --gpus 2 --batch-size 4 --warmup 2 --steps 5 --plain tp \
    --layouts starscream_tp --out "$out/mfu_llama3-8b_2gpu_tp.json"
elif [ "$part" = part2 ]; then
  # part2 (after part1 showed decode at 16% of bandwidth and Llama 3 8B at 4 x 2048 out of memory under the default
  # 75% preallocation): the decode step profiled, and with its layer scan unrolled; then 8B at 2 x 2048.
  CUDA_VISIBLE_DEVICES=1 python3 scripts/bench_decode.py --model llama3-8b --batches 1 64 --cache 4096 --steps 30 \
    --profile-dir /tmp/decode_profiles --out "$out/decode_llama3-8b_1gpu_profiled.json"
  CUDA_VISIBLE_DEVICES=1 python3 scripts/bench_decode.py --model llama3-8b --batches 1 64 --cache 4096 --steps 30 \
    --unroll 32 --out "$out/decode_llama3-8b_1gpu_unroll32.json"
  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
  python3 scripts/bench_mfu.py --model llama3-8b --gpus 2 --batch-size 2 --warmup 2 --steps 5 --plain tp \
    --layouts starscream_tp --out "$out/mfu_llama3-8b_2gpu_tp.json"
  python3 scripts/bench_mfu.py --model llama3-8b --grouping 0,1 --batch-size 2 --warmup 2 --steps 5 --plain fsdp \
    --layouts starscream_fsdp --out "$out/mfu_llama3-8b_2gpu_fsdp.json"
elif [ "$part" = part4 ]; then
  # part4, one H200: decode as generation now runs it (layer loop unrolled, cuDNN attention on the cache) profiled;
  # the 1B training step with the layer weights cast to bfloat16 once per step, beside the tree before that change
  # (each beside its own plain JAX run); then cuBLAS in place of XLA's Triton GEMMs, for decode and training.
  base=$3
  timeout 150 python3 scripts/bench_decode.py --model llama3-8b --batches 1 64 --cache 4096 --steps 30 \
    --profile-dir /tmp/decode_profiles --out "$out/decode_llama3-8b_1gpu.json"
  timeout 90 python3 scripts/bench_mfu.py --layouts starscream_tp --plain dp --out "$out/mfu_llama3.2-1b_1gpu.json"
  (cd "$base" && PYTHONPATH=$PWD timeout 90 python3 scripts/bench_mfu.py --layouts starscream_tp --plain dp \
    --out "$out/mfu_llama3.2-1b_1gpu_cast_in_loop.json")
  export XLA_FLAGS=--xla_gpu_enable_triton_gemm=false
  timeout 120 python3 scripts/bench_decode.py --model llama3-8b --batches 1 64 --cache 4096 --steps 30 \
    --out "$out/decode_llama3-8b_1gpu_cublas.json"
  timeout 90 python3 scripts/bench_mfu.py --layouts starscream_tp --plain dp \
    --out "$out/mfu_llama3.2-1b_1gpu_cublas.json"
elif [ "$part" = part5 ]; then
  # part5, one H200 (run twice: decode attention as multiplies and sums, then cuDNN's with XLA's dynamic-slice
  # fusion): decode as the tree runs it, profiled, then the same with cuBLAS GEMMs.
  timeout 150 python3 scripts/bench_decode.py --model llama3-8b --batches 1 64 --cache 4096 --steps 30 \
    --profile-dir /tmp/decode_profiles --out "$out/decode_llama3-8b_1gpu.json"
  XLA_FLAGS=--xla_gpu_enable_triton_gemm=false timeout 150 python3 scripts/bench_decode.py --model llama3-8b \
    --batches 1 64 --cache 4096 --steps 30 --profile-dir /tmp/decode_profiles_cublas \
    --out "$out/decode_llama3-8b_1gpu_cublas.json"
elif [ "$part" = part7 ]; then
  # part7, one H200: decode as the library now runs it (cache held per layer, cuDNN attention, cuBLAS GEMMs set by
  # the decode step's own compiler options, no XLA_FLAGS), profiled.
  timeout 150 python3 scripts/bench_decode.py --model llama3-8b --batches 1 64 --cache 4096 --steps 30 \
    --profile-dir /tmp/decode_profiles --out "$out/decode_llama3-8b_1gpu.json"
elif [ "$part" = part8 ]; then
  # part8, one H200: the 1B training step with the target's logit picked as a masked sum (no scatter in the loss's
  # gradient), beside the tree before that change (BASE_TREE), each beside its own plain JAX run.
  base=$3
  timeout 90 python3 scripts/bench_mfu.py --layouts starscream_tp --plain dp --out "$out/mfu_llama3.2-1b_1gpu.json"
  (cd "$base" && PYTHONPATH=$PWD timeout 90 python3 scripts/bench_mfu.py --layouts starscream_tp --plain dp \
    --out "$out/mfu_llama3.2-1b_1gpu_take_along_axis.json")
elif [ "$part" = part9 ]; then
  # part9, two H200s (not yet run): the 1B comparisons of part1 again now that no phase runs a layer loop (each side
  # also with its rolled loop, --unroll 1), then part6's Llama 3 8B runs.
  timeout 240 python3 scripts/bench_mfu.py --gpus 2 --plain dp tp --layouts starscream_tp starscream_fsdp --unroll 1 \
    --out "$out/mfu_llama3.2-1b_2gpu.json"
  bash "$0" part6 "$out"
elif [ "$part" = part6 ]; then
  # part6, two H200s: Llama 3 8B, one parallelism per process so that each ends inside its own limit.
  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
  timeout 200 python3 scripts/bench_mfu.py --model llama3-8b --grouping 0,1 --batch-size 2 --warmup 2 --steps 5 \
    --plain fsdp --layouts starscream_fsdp --out "$out/mfu_llama3-8b_2gpu_fsdp.json"
  timeout 200 python3 scripts/bench_mfu.py --model llama3-8b --gpus 2 --batch-size 2 --warmup 2 --steps 5 \
    --plain tp --layouts starscream_tp --out "$out/mfu_llama3-8b_2gpu_tp.json"
elif [ "$part" = part10 ]; then
  # part10, one H200 (not yet run): the 8-bit decode kernels compiled and matched, then the dense 8-bit cache steps
  # (bf16 weights on cuBLAS since steps.decode_options) and the engine's paged step over int8 pages, gathered and
  # read in place, side by side in one process, each variant traced.
  timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/model/test_eight_bit_decode.py \
    tests/model/test_paged.py
  with_torch 420 scripts/bench_decode.py --variants bf16 kv-int8 kv-fp8 --batches 1 64 --no-torch \
    --paged gather cudnn --paged-cache int8 --profile-dir /tmp/decode_profiles --out "$out/decode_kv_in_place.json"
  (cd /tmp && tar czf "$out/decode_profiles.tgz" $(find decode_profiles -name '*.trace.json.gz' -o -name '*.xplane.pb' \
    | head -40))
elif [ "$part" = part11 ]; then
  # part11, one H200: workload A in process beside the static generate at batch 64 (the faster of two passes).
  timeout 590 python3 scripts/bench_serve.py --workload A --static-generate 64 --out "$out/serve_a_static_best_of_two.json"
elif [ "$part" = part12 ]; then
  # part12, one H200: the fp8 training step of Llama 3.2 3B beside bf16, each traced, to find where 1.2x stops.
  timeout 590 python3 scripts/bench_mfu.py --model llama3.2-3b --batch-size 4 --seq-len 2048 --layouts starscream_tp \
    --plain --no-torch --fp8 --profile-dir /tmp/fp8_profiles --out "$out/mfu_llama3.2-3b_1gpu_fp8_profiled.json"
  (cd /tmp && tar czf "$out/fp8_profiles.tgz" fp8_profiles)
elif [ "$part" = part13 ]; then
  # part13, one H200: the 8-bit decode kernels' GPU tests (a loop step of whole pages, the loop ending at the row's
  # length), a sweep of the 8-bit cache kernel's tilings beside cuDNN's bf16 reads, the fp8 3B step's compiled
  # program (to name the fusions part12's trace shows), and the 8-bit cache steps, paged in place.
  timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/model/test_eight_bit_decode.py \
    tests/model/test_paged.py 2>&1 | tail -5
  timeout 200 python3 scripts/bench_paged_attention.py --eight-bit int8 --shapes 64:4096:16:4096 1:4096:16:4096 \
    64:4096:16:1000 --tilings 64:4:2 64:4:3 128:4:2 128:4:3 128:8:3 256:8:2 256:8:3 64:8:4 --calls 20 \
    --out "$out/paged_attention_int8_tilings.json"
  timeout 120 python3 scripts/bench_mfu.py --model llama3.2-3b --batch-size 4 --seq-len 2048 --layouts starscream_tp \
    --plain --no-torch --fp8 --compile-only --hlo-dir /tmp/fp8_hlo --out /tmp/fp8_compile.json > /dev/null 2>&1
  (cd /tmp && tar czf "$out/fp8_hlo.tgz" fp8_hlo)
  with_torch 240 scripts/bench_decode.py --variants bf16 kv-int8 --batches 1 64 --no-torch --paged cudnn \
    --paged-cache int8 --out "$out/decode_kv_int8_paged_pages_a_step.json"
elif [ "$part" = part14 ]; then
  # part14, one H200: the 8-bit cache kernel at part13's fastest tiling (128 positions a step, 4 warps, 3 stages) as
  # its default: the GPU tests, the dense 8-bit cache steps and the paged one beside bf16, and one layer's kernels.
  timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/model/test_eight_bit_decode.py \
    tests/model/test_paged.py 2>&1 | tail -4
  with_torch 260 scripts/bench_decode.py --variants bf16 kv-int8 kv-fp8 --batches 1 64 --no-torch --paged cudnn \
    --paged-cache int8 --out "$out/decode_kv_8_bit_tiled.json"
  timeout 60 python3 scripts/bench_paged_attention.py --eight-bit int8 --shapes 64:4096:16:4096 \
    --tilings 128:4:3 128:4:4 256:4:3 --calls 20 --out "$out/paged_attention_int8_tiled.json"
elif [ "$part" = part15 ]; then
  # part15, one H200 (runs 97-99 ran its parts): the 8-bit kernels' GPU tests (the paged form's pages loaded apart
  # too), the paged form's pages gathered against loaded apart at several tilings, then the 8-bit cache steps with
  # the tilings chosen by shape (batch 1: 64 / 4 / 2; batch 64: 128 / 4 / 3) in one process.
  timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/model/test_eight_bit_decode.py \
    tests/model/test_paged.py 2>&1 | tail -4
  timeout 150 python3 scripts/bench_paged_attention.py --eight-bit int8 --shapes 64:4096:16:4096 1:4096:16:4096 \
    64:4096:16:1000 --tilings 64:4:2 128:4:3 64:4:2:apart 128:4:3:apart 128:8:3:apart 256:8:3:apart --calls 20 \
    --out "$out/paged_attention_int8_pages_apart.json"
  with_torch 260 scripts/bench_decode.py --variants bf16 kv-int8 kv-fp8 --batches 1 64 --no-torch --paged cudnn \
    --paged-cache int8 --out "$out/decode_kv_8_bit_by_shape.json"
elif [ "$part" = part16 ]; then
  # part16, one H200 (run 96 ran its bench: 1.258x): fp8 training with each e4m3 weight moved into its forward GEMM's
  # layout by the byte transpose kernel (BackendPolicy.byte_transpose), beside bf16 and traced as part12 was.
  timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/model/test_byte_transpose.py 2>&1 | tail -4
  timeout 400 python3 scripts/bench_mfu.py --model llama3.2-3b --batch-size 4 --seq-len 2048 --layouts starscream_tp \
    --plain --no-torch --fp8 --profile-dir /tmp/fp8_profiles --out "$out/mfu_llama3.2-3b_1gpu_fp8_byte_transpose.json"
elif [ "$part" = part17 ]; then
  # part17, one H200: workload A on one engine with each step's prompt chunk (one a shard, the default) and decode
  # rows as one mixed program and as two (the same engine, mixed steps turned off), beside the static generate at
  # batch 64. (Run 95 asked for mixed steps of 16 chunks: 61 programs, 12 compiled in the call's first 411 s.)
  timeout 590 python3 scripts/bench_serve.py --workload A --compare-two-programs --static-generate 64 \
    --out "$out/serve_a_mixed_steps.json"
elif [ "$part" = part18 ]; then
  # part18, one H200 (not yet run): the mixed step's GPU tests (the engine's tokens against the unsharded model's, the
  # paged attention of a mixed stream through cuDNN's kernel), then workload B (8 requests/s) with mixed steps and with
  # two programs a step, where a prompt's chunk shares its step with a few dozen decode rows (TPOT and TTFT).
  timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/serving/test_engine.py tests/model/test_paged.py \
    2>&1 | tail -4
  timeout 430 python3 scripts/bench_serve.py --workload B --compare-two-programs --out "$out/serve_b_mixed_steps.json"
elif [ "$part" = part19 ]; then
  # part19, one H200 (not yet run): the Mosaic GPU weight-only kernel (TMA copies into a ring of shared-memory stages,
  # warpgroup MMA of the converted weight tile by x's) compiled against the dequantized product, then timed beside the
  # Triton kernel, XLA's converting GEMM and bfloat16's cuBLAS GEMM on each projection of Llama 3 8B at 1 and 64 rows,
  # and on one layer's seven projections (four launches each: the grouped Triton kernel's and the Mosaic kernel's).
  timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/model/test_weight_only_mosaic.py 2>&1 | tail -4
  timeout 240 python3 scripts/bench_weight_only.py --budget-s 0 --out "$out/h200_weight_only_mosaic.json"
  timeout 150 python3 scripts/bench_weight_only.py --layer-only --rows 1 64 \
    --out "$out/h200_weight_only_layer_mosaic.json"
elif [ "$part" = part20 ]; then
  # part20, one H200 (not yet run): the fp8 training step of Llama 3.2 3B with its vocabulary projection in fp8 too
  # (its three GEMMs are the largest left in bfloat16, 8.2 ms each in run 92's trace) beside the fp8 and bfloat16
  # steps (the step-0 losses checked against plain JAX bfloat16 within 0.05 nats).
  timeout 590 python3 scripts/bench_mfu.py --model llama3.2-3b --batch-size 4 --seq-len 2048 --layouts starscream_tp \
    --plain --no-torch --fp8 --fp8-logits --out "$out/mfu_llama3.2-3b_1gpu_fp8_logits.json"
else
  # part3 (not run: superseded by part5): the 8B runs part2 did not reach, and collective matmul for TP.
  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
  python3 scripts/bench_mfu.py --model llama3-8b --gpus 2 --batch-size 2 --warmup 2 --steps 5 --plain tp \
    --layouts starscream_tp --out "$out/mfu_llama3-8b_2gpu_tp.json"
  python3 scripts/bench_mfu.py --model llama3-8b --grouping 0,1 --batch-size 2 --warmup 2 --steps 5 --plain fsdp \
    --layouts starscream_fsdp --out "$out/mfu_llama3-8b_2gpu_fsdp.json"
  unset XLA_PYTHON_CLIENT_MEM_FRACTION
  XLA_FLAGS="--xla_gpu_threshold_for_windowed_einsum_mib=0 --xla_gpu_multi_streamed_windowed_einsum=true" \
    python3 scripts/bench_mfu.py --gpus 2 --plain tp --layouts starscream_tp \
    --out "$out/mfu_llama3.2-1b_2gpu_tp_collective_matmul.json"
fi
