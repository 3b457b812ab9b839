#!/usr/bin/env bash
# The fine-tuning finding of docs/finetune.md: pretrain the quick study's ViT with softmax on the
# scenes, then fine-tune that checkpoint for the same number of epochs seven ways, 3 seeds each.
# Run from the repository root: bash docs/study_results/finetune/commands.sh OUT_DIR
set -euo pipefail
OUT="${1:-runs/finetune}"
PRE="$OUT/pretrain"
vitattn study --attention softmax --epochs 10 --seeds 1 --out "$PRE" --no-progress
CKPT="$PRE/checkpoints/baseline-softmax-s0/model.safetensors"
FT=(--checkpoint "$CKPT" --epochs 5 --seeds 3 --lr 5e-4 --warmup-epochs 0 --no-progress)
vitattn study "${FT[@]}" --attention softmax --out "$OUT/softmax"
vitattn study "${FT[@]}" --attention locat --gaug-init identity --out "$OUT/locat"
vitattn study "${FT[@]}" --attention entmax15 --out "$OUT/entmax15"
vitattn study "${FT[@]}" --attention locat --gaug-init identity --prr --out "$OUT/locat-prr"
# the identity start with the GAug parameters' learning rate x100 (how far its gate goes when let),
# and the paper's start
vitattn study "${FT[@]}" --attention locat --gaug-init identity --gaug-lr-scale 100 --out "$OUT/locat-lr100"
vitattn study "${FT[@]}" --attention locat --gaug-init identity --gaug-lr-scale 100 --prr --out "$OUT/locat-prr-lr100"
vitattn study "${FT[@]}" --attention locat --gaug-init paper --out "$OUT/locat-paper"
