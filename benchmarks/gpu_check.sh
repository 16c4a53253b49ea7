#!/usr/bin/env bash
# The whole user path on one CUDA GPU, in under 8 minutes, with the very commands a user runs:
#   stand-in networks (random VAE, random open_clip, stand-in TorchScript Inception; no weights to fetch)
#   -> maskbench data synth (pixel shards) -> maskbench data encode (latent shards, 64 px -> 4x32x32)
#   -> maskbench eval reference (held-out pixels behind the latent val split)
#   -> maskbench run on the latents: dit_s2, bf16, Triton gather/scatter, torch.compile, a few hundred
#      steps, eval points with decoded samples, FID (stand-in Inception, labelled so), CLIP score, grid
#   -> what breaks first on a GPU: a demotion arm on latents (downscale_window on the encoded 0.5 latents,
#      sub-batches of changing size under compile), maskdit50 across its switch (a parameter idle in one phase)
#   -> maskbench repro -> kernel bandwidth, step-time ratios and MFU (benchmarks/*.py)
# Figures land in results/gpu_check.json (and a log per step in results/gpu_check/); GPU_CHECK_RESULTS
# puts them elsewhere, GPU_CHECK_DIR keeps the data and run (default: a fresh temporary folder).
# Exit status: 0 when every step passed (or when there is no GPU: one line says so), 1 otherwise.
#
#     bash benchmarks/gpu_check.sh            # on a GPU machine
#     bash benchmarks/gpu_check.sh --cpu      # the same commands at toy size on the CPU (a dry run of the script)
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-gpu}
if [ "$mode" != "--cpu" ] && ! python -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  echo "gpu_check: needs a CUDA GPU and this machine has none; nothing was run (--cpu runs a toy-size dry run)"
  exit 0
fi
work=${GPU_CHECK_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}
results=${GPU_CHECK_RESULTS:-results}
logs=$results/gpu_check
mkdir -p "$logs"
: > "$logs/steps.tsv"
if [ "$mode" = "--cpu" ]; then  # toy sizes, no Triton or compile: checks the script, not the GPU
  n_train=256 n_val=64 batch=8 budget=3e10 small=2e10 n_samples=16 val_samples=32 fast="model.kernels=torch train.compile=false"
  model="model=dit_s2 model.depth=1 model.width=64 model.heads=2 eval.sampler_steps=4" benches=0
else
  n_train=8192 n_val=512 batch=128 budget=6e14 small=1.5e14 n_samples=256 val_samples=512 fast="model.kernels=triton train.compile=true"
  model="model=dit_s2" benches=1
fi

failed=0
# step LIMIT_S NAME COMMAND...: one step under a time limit; its output in results/gpu_check/NAME.log
step() {
  local limit=$1 name=$2
  shift 2
  echo "== $name (at most ${limit}s): $*"
  local start=$SECONDS
  timeout "$limit" "$@" > "$logs/$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >> "$logs/steps.tsv"
  tail -3 "$logs/$name.log"
  if [ $rc -eq 0 ]; then echo "== $name: ok in $((SECONDS - start))s"; else echo "== $name: FAILED ($rc)"; failed=1; fi
  return $rc
}

step 60 standins python -m maskbench.eval.standins "$work/standins" || exit 1
vae=$work/standins/vae clip=local-dir:$work/standins/standin-clip inception=$work/standins/standin-inception.pt
step 60 synth maskbench data synth paths.data="$work/data" data.n_train=$n_train data.n_val=$n_val || exit 1
synth=$(ls -d "$work"/data/synth-*/ | head -1); synth=${synth%/}  # the folder, not its .lock
for split in train val; do
  step 120 "encode_$split" maskbench data encode "$synth/$split" "$work/latent/$split" --vae "$vae" \
    --text-model "$clip" --resolution 64 --batch-size 64 --demote 0.5 --no-progress || exit 1
done
step 60 reference maskbench eval reference "$work/latent/val" eval.inception_weights="$inception" || exit 1
common="data.path=$work/latent $model $fast train.batch_size=$batch eval.n_samples=$n_samples
  eval.val_samples=$val_samples eval.inception_weights=$inception eval.clip_model=$clip"
# Two loader workers: batches cross a process boundary (pinned on CUDA), in the data order of any worker count.
step 300 run maskbench run arm=mask75_then0 $common data.num_workers=2 budget.flops=$budget eval.points=[0.25,1.0] \
  paths.runs="$work/runs" paths.leaderboard="$work/leaderboard.csv" || exit 1
run_dir=$(ls -d "$work"/runs/*/ | head -1); run_dir=${run_dir%/}
step 200 demote maskbench run arm=downscale_window $common budget.flops=$small eval.points=[1.0] \
  paths.runs="$work/runs_more" paths.leaderboard="$work/leaderboard_more.csv"
step 200 maskdit maskbench run arm=maskdit50 $common budget.flops=$small eval.points=[1.0] \
  paths.runs="$work/runs_more" paths.leaderboard="$work/leaderboard_more.csv"
step 240 repro maskbench repro "$run_dir"
if [ "$benches" = 1 ]; then
  step 120 kernels python benchmarks/kernels.py --out "$logs/kernels.csv"
  step 150 step_time python benchmarks/step_time.py --device cuda --models dit_s2 cpu_mfu --out "$logs/step_time.csv"
fi
python benchmarks/gpu_check_report.py "$run_dir" "$logs" --out "$results/gpu_check.json" || failed=1
echo "gpu_check: $([ $failed = 0 ] && echo all steps passed || echo some steps FAILED); figures in $results/gpu_check.json"
exit "$failed"
