#!/usr/bin/env bash
# The second, optional device command: speed at real sizes, after benchmarks/gpu_check.sh has shown it runs.
#
#     bash benchmarks/device/gpu_bench.sh [--out DIR]          # on a CUDA GPU: at most about 7.5 minutes
#     bash benchmarks/device/gpu_bench.sh --cpu [--out DIR]    # the same steps at toy size (a dry run)
#     bash benchmarks/device/gpu_bench.sh --plan               # the steps and their limits
#
# Steps, each under `timeout -k` (the GPU limits add up to 420 s; +3 s each to kill):
#   env            as in gpu_check: the device, the packages, the bf16 matrix product's TFLOP/s (MFU's measured peak)
#   step_time      benchmarks/step_time.py on dit_b2 (batch 256) and dit_xl2 (batch 64: what fits 80 GB with room,
#                  its arithmetic in step_time.py), 32x32x4 latents, bf16 autocast, eager: seconds per step at
#                  mask 0 and 0.75, the time ratio against the FLOPs ratio, the peak memory, MFU against the spec
#                  sheet (989 TFLOP/s) and, in the report, against the measured product (~790)
#   arm_step_time  benchmarks/arm_step_time.py on dit_b2: seconds per TFLOP of the trainer's whole step per arm
#                  and phase, relative to mask0's
#   loader         benchmarks/loader.py: samples/s per loader worker, and the workers an H200 needs
#   synth, run, repro
#                  a small run on synth pixels, then `maskbench repro` of it on the GPU (relative tolerance)
# env and step_time write each finding and each model's rows the moment they exist, so a step cut by its limit is
# reported as "timed out after N of M items" with those N (benchmarks/device/steps.sh: GPU_CHECK_LIMIT_S forces
# every limit, GPU_CHECK_STEPS runs some steps only). The report and the tar go under DIR as gpu_bench.json and
# gpu_bench.tar.gz (the kit prints the command).
set -uo pipefail
cd "$(dirname "$0")/../.."
NAME=gpu_bench STEPS=env,step_time,arm_step_time,loader,synth,run,repro
. benchmarks/device/steps.sh
parse_args "$@"
if [ "$mode" = cpu ]; then  # step_time: tiny, then dit_b2 on one thread (~45 s here), a model the GPU run times
  L_ENV=60 L_STEP_TIME=120 L_ARM_STEP_TIME=120 L_LOADER=120 L_SYNTH=60 L_RUN=120 L_REPRO=240
  step_time="--models tiny dit_b2 --batch 2 --steps 3 --warmup 1 --threads 1" arm_step_time="--smoke" loader="--smoke"
  batch=8 budget=1.5e9
  toy="model=tiny model.width=32 model.depth=3 model.heads=2 model.text_width=32 model.text_depth=1 model.text_len=24"
else
  L_ENV=20 L_STEP_TIME=90 L_ARM_STEP_TIME=90 L_LOADER=50 L_SYNTH=20 L_RUN=70 L_REPRO=80
  step_time="--models dit_b2 dit_xl2 --steps 10 --warmup 3"
  arm_step_time="--model dit_b2 --batch 128 --steps 8 --warmup 2 --arms mask0 mask75 mask75_then0 maskdit50 tread50 sprint75 lsc"
  loader="--gpu H200 --max-seconds 4" batch=128 budget=1e11
  toy="model=tiny model.width=64 model.depth=3 model.heads=2 model.text_width=64 model.text_depth=1 model.text_len=24"
fi
start

step env $PY benchmarks/device/env_check.py --out "$work/env.jsonl" $([ "$mode" = cpu ] && echo --cpu)
step step_time $PY benchmarks/step_time.py $step_time --out "$work/step_time.csv"
step arm_step_time $PY benchmarks/arm_step_time.py $arm_step_time --out "$work/arm_step_time.csv"
step loader $PY benchmarks/loader.py $loader --data "$work/loader_data" --out "$work/loader.csv"
step synth $PY -m maskbench data synth paths.data="$work/data" data.n_train=1024 data.n_val=64
synth=$(ls -d "$work"/data/synth-*/ 2>/dev/null | head -1); synth=${synth%/}
step run $PY -m maskbench run arm=mask75_then0 data.path="$synth" paths.data="$work/data" $toy \
  train.batch_size=$batch train.warmup_steps=2 budget.flops=$budget eval.points=[0.5,1.0] eval.n_samples=16 \
  eval.val_samples=16 eval.sampler_steps=2 eval.batch_size=16 eval.grid_size=4 data.shuffle_buffer=32 \
  paths.runs="$work/bench/runs" paths.leaderboard="$work/bench/leaderboard.csv"
run_dir=$(ls -d "$work"/bench/runs/*/ 2>/dev/null | head -1)
step repro $PY -m maskbench repro "${run_dir%/}"
exit "$failed"
