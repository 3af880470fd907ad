#!/usr/bin/env bash
# Every GPU check in one run, for a machine with CUDA where the package and its dependencies import
# (the SmolLM2 checkpoint with heads in $SPECROLL_CACHE, or converted on first use):
#
#   bash tools/gpu_checks.sh OUT_DIR            # about 8 minutes on one H200
#
# Stages, in order of value, each under its own time limit and skipped when the overall budget
# (BUDGET_S seconds, default 540) would run out or when named in SKIP (e.g. SKIP="tests grpo"):
# tests/gpu, the exactness fuzz in float64 on the GPU's paths (tools/fuzz_exactness.py: SpecRoll against
# the vanilla engine under random settings, token for token) and in float32 (the share of responses
# near-ties part, against 0.1%), the capacity profile (C_hw on this GPU), SpecRoll against the vanilla engine and
# transformers at T=1 at batch 1, then on 32 prompts x 8 samples x 256 tokens (with SpecRoll pricing
# each step's forward alone, without the work around it, in the alternation), a SmolLM2-shaped forward
# with the layers chained against megatron's block (tools/bench_forward_path.py), the speculative step's
# host work per phase at batch 1 (ms, operations and syncs a step; both engines' whole rollouts in
# operations a token), the same with acceptance walking the trees depth by depth (a CPU's way; a GPU
# samples every node at once), a short GRPO run that times the vanilla engine on the same steps, batch 1 at
# T=0, the big batch in bfloat16 (how many responses stay identical to the vanilla engine's:
# cuBLAS and attention kernels are not batch-invariant, so near-ties are frequent there), and the
# policy update of a bfloat16 SmolLM2 on 8 x 1024 tokens with its causal attention (FlashAttention's
# kernel) against an explicit causal mask (tools/bench_update.py --compare-attention), and a prompt of
# 8192 tokens prefilled in one forward against pieces (tools/bench_prefill.py, max_prefill_tokens).
# Logs go to OUT_DIR/gpu_checks.log, results to OUT_DIR/*.json|png|jsonl. QUICK=1 shrinks every
# workload to a few tokens and only collects tests/gpu (which the default suite runs itself): a dry
# run of this script on any machine (`make test-slow` runs one).
set -uo pipefail
OUT=${1:?usage: tools/gpu_checks.sh OUT_DIR}
PY=${PY:-python3}
BUDGET_S=${BUDGET_S:-540}
CKPT=${CKPT:-smollm2}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
LOG="$OUT/gpu_checks.log"
deadline=$((SECONDS + BUDGET_S))

if [ "${QUICK:-0}" = 1 ]; then
  B1="--batch1-prompts 1 --max-new-tokens 8 --reps 1"; FULL="--prompts 2 --samples 2 --max-new-tokens 8 --reps 1"
  TOKENS="1,2,4"
  GRPO="--set steps=2 --set prompts_per_step=2 --set sampling.num_samples=2 --set sampling.max_new_tokens=8"
  PHASES="--max-new-tokens 8 --steps 2 --reps 1"
  FWD="--layers 2 --hidden 64 --ffn 128 --heads 4 --kv-heads 2 --vocab 512 --shapes 1x1,2x4 --reps 1"
  TESTS="--collect-only"
  UPDATE="--prompts 1 --samples 2 --max-new-tokens 8 --reps 1"
  PREFILL="--prompt-tokens 64 --pieces 16 --reps 1"
  FUZZ="--cases 2"
else  # a 1-token forward of SmolLM2 takes ~30 ms on an H200 (host-bound): batch 1 is the slow stage
  B1="--batch1-prompts 2 --max-new-tokens 256 --reps 3"; FULL="--prompts 32 --samples 8 --max-new-tokens 256 --reps 2"
  TOKENS="1,2,4,8,16,32,64,128,256,512,1024,2048"
  GRPO="--set steps=4 --set prompts_per_step=8 --set sampling.num_samples=8 --set sampling.max_new_tokens=256"
  PHASES="--max-new-tokens 64 --steps 30 --reps 3"
  FWD="--reps 30"
  TESTS=""
  UPDATE="--prompts 1 --samples 8 --max-new-tokens 1024 --micro-batch-size 8 --reps 3"
  PREFILL="--prompt-tokens 8192 --pieces 1024,2048,4096 --reps 3"
  FUZZ="--minutes 1"
fi

skipped() {  # skipped NAME: whether stage NAME is in SKIP or the budget is spent (said in the log)
  local left=$((deadline - SECONDS))
  if [[ " ${SKIP:-} " == *" $1 "* ]]; then echo "== $1 skipped: in SKIP" | tee -a "$LOG"; return 0; fi
  if [ "$left" -lt 30 ]; then echo "== $1 skipped: ${left}s of the budget left" | tee -a "$LOG"; return 0; fi
  return 1
}

stage() {  # stage NAME LIMIT_S CMD...: run CMD under min(LIMIT_S, time left), log it, never abort the rest
  local name=$1 limit=$2
  shift 2
  skipped "$name" && return
  local left=$((deadline - SECONDS))
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit}s): $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
  echo "== $name rc=${PIPESTATUS[0]} in $((SECONDS - t0))s" | tee -a "$LOG"
}

$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
torch.cuda.get_device_name() if torch.cuda.is_available() else '')" 2>&1 | tee -a "$LOG"
# shellcheck disable=SC2086
stage tests 120 $PY -m pytest -q $TESTS tests/gpu
# shellcheck disable=SC2086
stage fuzz 80 $PY tools/fuzz_exactness.py $FUZZ --out "$OUT/fuzz_exactness.json"
# shellcheck disable=SC2086
stage fuzz_f32 80 $PY tools/fuzz_exactness.py --dtype float32 $FUZZ --out "$OUT/fuzz_exactness_f32.json"
stage profile 120 $PY tools/profile_capacity.py --checkpoint "$CKPT" --tokens "$TOKENS" --out "$OUT/capacity.json"
# shellcheck disable=SC2086
stage bench_batch1 180 $PY tools/bench_specroll.py --checkpoint "$CKPT" $B1 --skip-full --out "$OUT/bench_specroll_b1.json"
# shellcheck disable=SC2086
stage bench_full 200 $PY tools/bench_specroll.py --checkpoint "$CKPT" $FULL --skip-batch1 --forward-only \
  --out "$OUT/bench_specroll_full.json" --plot "$OUT/bench_specroll_full.png"
# shellcheck disable=SC2086
stage forward_path 60 $PY tools/bench_forward_path.py $FWD --out "$OUT/forward_path.json"
# shellcheck disable=SC2086
stage step_phases 90 $PY tools/bench_step_phases.py --checkpoint "$CKPT" $PHASES --out "$OUT/step_phases_b1.json"
# shellcheck disable=SC2086
stage step_phases_walk 90 env SPECROLL_ACCEPT_AT_ONCE=0 $PY tools/bench_step_phases.py --checkpoint "$CKPT" $PHASES \
  --out "$OUT/step_phases_b1_walk.json"
GRPO_DIR=$(mktemp -d)
# shellcheck disable=SC2086
stage grpo 240 $PY -m specroll_mcore.cli train --config examples/configs/smollm2_gsm8k_cpu.yaml \
  --set "checkpoint=$CKPT" --set "output_dir=$GRPO_DIR" --set save_every=1000 $GRPO
cp "$GRPO_DIR/metrics.jsonl" "$OUT/grpo_metrics.jsonl" 2>/dev/null
# shellcheck disable=SC2086
stage bench_batch1_t0 100 $PY tools/bench_specroll.py --checkpoint "$CKPT" $B1 --temperature 0 --skip-full --skip-hf \
  --out "$OUT/bench_specroll_b1_t0.json"
# shellcheck disable=SC2086
stage bench_full_bf16 90 $PY tools/bench_specroll.py --checkpoint "$CKPT" --dtype bfloat16 $FULL --reps 1 --skip-batch1 \
  --skip-hf --out "$OUT/bench_specroll_full_bf16.json" --plot "$OUT/bench_specroll_full_bf16.png"
if ! skipped update_attention; then
  UPDATE_CKPT=$CKPT
  if [ "$CKPT" = smollm2 ] && [ "${QUICK:-0}" != 1 ]; then  # the update in bfloat16: FlashAttention's dtypes
    UPDATE_CKPT=$(mktemp -d)/smollm2-bf16
    timeout $((deadline - SECONDS)) $PY -m specroll_mcore.cli convert hf-to-mcore "$($PY -c 'from specroll_mcore.checkpoint.smollm2 \
import default_hf_dir; print(default_hf_dir())')" "$UPDATE_CKPT" --dtype bfloat16 2>&1 | tail -1 | tee -a "$LOG"
  fi
  # shellcheck disable=SC2086
  stage update_attention 120 $PY tools/bench_update.py --checkpoint "$UPDATE_CKPT" --compare-attention $UPDATE \
    --set sampling.ignore_eos=true --out "$OUT/bench_update_attention.json"
fi
# shellcheck disable=SC2086
stage prefill 60 $PY tools/bench_prefill.py --checkpoint "$CKPT" $PREFILL --out "$OUT/bench_prefill.json"
echo "== done in ${SECONDS}s" | tee -a "$LOG"
