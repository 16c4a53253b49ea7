#!/usr/bin/env bash
# The first command on a GPU machine: one run of at most 8 minutes that brings back the evidence maskbench lacks.
#
#     bash benchmarks/gpu_check.sh [--out DIR]          # on a CUDA GPU (an H200: about 7 minutes at most)
#     bash benchmarks/gpu_check.sh --cpu [--out DIR]    # the same steps at toy size on the CPU (a dry run)
#     bash benchmarks/gpu_check.sh --plan               # the steps and their time limits; runs nothing
#
# On an air-gapped device, run it through the kit's command (bash benchmarks/device/kit.sh prints it), which
# installs the wheels the device lacks and passes --out "$OUT".
#
# Steps, each under `timeout -k` with its own limit (the GPU limits add up to 420 s; +3 s each to kill):
#   env        every module the later steps import, timed, with the version and folder of each package it loaded
#              (before any CUDA call); CUDA usable, the device (name, multiprocessors, memory), a bf16 matrix
#              product (checked, TFLOP/s) and a 2 GiB copy (GB/s)
#   kernels    the Triton gather/scatter against torch, forward and backward, checked then timed: GB/s against
#              the spec peak and the measured copy (benchmarks/kernels.py --quick)
#   standins, synth, encode, reference
#              stand-in VAE, CLIP and Inception (no weights to fetch); synth pixel shards; latent shards
#              (maskbench data encode, 64 px -> 4x32x32, with --demote 0.5); FID reference statistics
#   train      a compiled mask75_then0 (Triton kernels, bf16, Inductor) of a few hundred steps on the latents,
#              through one evaluation: FID (stand-in Inception), CLIP score (stand-in CLIP), the sample grid;
#              Dynamo's graph, graph-break and recompile counts
#   arms       every shipped arm for a few steps on the synth pixels, Triton kernels, compile on, bf16, with
#              Dynamo's counts per arm (Dynamo's aot_eager backend: the same graphs, breaks and recompiles as
#              Inductor, without its code generation), and each arm's draws (t, dropout, noise) against mask0's
#   ddp        two processes on the one GPU (torchrun, gloo) sweeping maskdit50 and mask75_until_cosine (its rule
#              checked every 2 steps) across their switches: DDP with a parameter idle in one phase, the probe
# A failed step does not stop the others. The steps that measure several items (env's findings, kernels' rows,
# arms) write each the moment it exists, so a step cut by its limit is reported as "timed out after N of M items"
# with those N. After every step the report is rewritten, so whatever has run is reported even if the whole
# command is cut short; at the end the logs and grids are packed.
#
# Results, and nothing else, go under DIR (default: results/): gpu_check.json (each step's status, seconds,
# limit, items and first error line, then the figures) and gpu_check.tar.gz (logs/, grids/, the runs' metrics and
# eval records). The data and runs live in GPU_CHECK_DIR (default: a fresh temporary folder). GPU_CHECK_ARMS
# limits the arms step to the arms named (default: every shipped arm); GPU_CHECK_LIMIT_S forces every step's
# limit, GPU_CHECK_STEPS runs some steps only (benchmarks/device/steps.sh).
# Exit status: 0 when every step passed (or when there is no GPU: one line says so), 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
NAME=gpu_check STEPS=env,kernels,standins,synth,encode,reference,train,arms,ddp
. benchmarks/device/steps.sh
parse_args "$@"
if [ "$mode" = cpu ]; then  # toy sizes, Triton interpreted where installed, no Inductor: checks the script
  L_ENV=60 L_KERNELS=60 L_STANDINS=60 L_SYNTH=60 L_ENCODE=120 L_REFERENCE=60 L_TRAIN=240 L_ARMS=1800 L_DDP=300
  n_train=128 n_val=32 batch=8 n_samples=8 val_samples=16 jobs=1 kernels_args="--smoke" arms_deadline=1700
  toy="model=tiny model.width=32 model.depth=3 model.heads=2 model.text_width=32 model.text_depth=1 model.text_len=24"
  train_model="model=dit_s2 model.depth=1 model.width=64 model.heads=2" train_budget=8e9 train_compile=false
  kernels=torch arm_budget=1e9 ddp_budget=1.5e9 sampler=2 backend=aot_eager
  ddp_threads=1  # two processes on (often) two cores: a second thread each oversubscribes them (2x slower)
else
  L_ENV=20 L_KERNELS=40 L_STANDINS=20 L_SYNTH=20 L_ENCODE=40 L_REFERENCE=20 L_TRAIN=100 L_ARMS=110 L_DDP=50
  n_train=4096 n_val=256 batch=128 n_samples=256 val_samples=256 jobs=6 kernels_args="--quick" arms_deadline=85
  toy="model=tiny model.width=64 model.depth=3 model.heads=2 model.text_width=64 model.text_depth=1 model.text_len=24"
  train_model="model=dit_s2 model.depth=2" train_budget=1e14 train_compile=true
  kernels=triton arm_budget=1.2e11 ddp_budget=2e11 sampler=8 backend=aot_eager
  ddp_threads=2
fi
start

cpu_flag=$([ "$mode" = cpu ] && echo --cpu)
step env $PY benchmarks/device/env_check.py --out "$work/env.jsonl" $cpu_flag
step kernels $PY benchmarks/kernels.py $kernels_args --out "$work/kernels.csv"

step standins $PY -m maskbench.eval.standins "$work/standins"
vae=$work/standins/vae clip=local-dir:$work/standins/standin-clip inception=$work/standins/standin-inception.pt
step synth $PY -m maskbench data synth paths.data="$work/data" data.n_train=$n_train data.n_val=$n_val
synth=$(ls -d "$work"/data/synth-*/ 2>/dev/null | head -1); synth=${synth%/}  # the folder, not its .lock
encode() {  # both splits, 64 px -> 4x32x32 latents, with the 0.5 demotion
  for split in train val; do
    $PY -m maskbench data encode "$synth/$split" "$work/latent/$split" --vae "$vae" --text-model "$clip" \
      --resolution 64 --batch-size 64 --demote 0.5 --no-progress || return 1
  done
}
export PY work synth vae clip
export -f encode
step encode bash -c encode
step reference $PY -m maskbench eval reference "$work/latent/val" eval.inception_weights="$inception"

# Two loader workers: batches cross a process boundary (pinned on CUDA), in the data order of any worker count.
step train $PY benchmarks/device/wrap.py --dynamo-out "$work/train_dynamo.json" -- run arm=mask75_then0 \
  data.path="$work/latent" $train_model model.kernels=$kernels train.compile=$train_compile train.batch_size=$batch \
  data.num_workers=2 budget.flops=$train_budget eval.points=[1.0] eval.n_samples=$n_samples \
  eval.val_samples=$val_samples eval.sampler_steps=$sampler eval.inception_weights="$inception" eval.clip_model="$clip" \
  paths.runs="$work/train/runs" paths.leaderboard="$work/train/leaderboard.csv"

# No loader workers for the toy arms: the shards (--jobs) already share the machine's CPUs, and workers sized from
# them (8 a loader on 16 CPUs) would put ~48 processes beside the compilers for batches a process reads in microseconds.
small="data.path=$synth paths.data=$work/data $toy model.kernels=$kernels train.batch_size=$batch train.warmup_steps=2
  eval.points=[1.0] eval.n_samples=8 eval.val_samples=16 eval.sampler_steps=2 eval.batch_size=16 eval.grid_size=4
  data.shuffle_buffer=32 data.num_workers=0"
arms=${GPU_CHECK_ARMS:-}
step arms $PY benchmarks/device/arms_check.py --work "$work/arms" --out "$work/arms.jsonl" --jobs $jobs \
  --backend $backend --deadline-s $arms_deadline ${arms:+--arms $arms} -- $small train.compile=true \
  budget.flops=$arm_budget

ddp() {  # the rule arm's file, a sweep of the two arms on 2 processes sharing the GPU, then: did each cross its switch?
  local rule
  rule=$($PY benchmarks/device/arms_check.py --work "$work/ddp" --rule-arm-only) || return 1
  OMP_NUM_THREADS=$ddp_threads $PY -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/device/wrap.py \
    --gloo --dynamo-out "$work/ddp_dynamo.json" -- sweep "arm=maskdit50,$rule" $small train.compile=false \
    budget.flops=$ddp_budget paths.runs="$work/ddp/runs" paths.leaderboard="$work/ddp/leaderboard.csv" &&
  $PY benchmarks/gpu_check_report.py "$work" --check-switches "$work/ddp/runs"
}
export small ddp_budget ddp_threads
export -f ddp
step ddp bash -c ddp
exit "$failed"
