#!/usr/bin/env bash
# One lent GPU call (training/README.md, "llada-small-chat on a GPU"): the kernel check, then
# three trainings of LLaDA's SFT recipe side by side on the one GPU for MINUTES each:
#   small     the committed 9-layer model continued (--init checkpoints/llada-small-chat)
#   large12   a larger shape: all 12 layers of the default model converted (--from-sdar)
#   control9  the 9-layer conversion from the default model, for the same minutes (the
#             control for large12: same start, same recipe, fewer layers)
# then each scored by the script (LLaDA's loop, EVAL_PER_FAMILY per family). Needs torch,
# transformers, tokenizers and safetensors; no vLLM. Writes at most 8 files under OUT:
# verify_kernels.{json,log}, {small,large12,control9}.log, small-bf16.safetensors and the
# small model's float32 weights in two shards (small-f32-{0,1}.safetensors).
# SMALL_ARGS adds train_llada.py arguments to the small run (e.g. "--family-weight range=4").
#   OUT=DIR MINUTES=5 EVAL_PER_FAMILY=20 bash training/gpu_llada.sh
set -u
: "${OUT:?}" "${MINUTES:=5}" "${EVAL_PER_FAMILY:=20}" "${VERIFY_SECONDS:=150}"
export PYTHONPATH=lab:. PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
WORK=${WORK:-/tmp/gpu-llada}
mkdir -p "$WORK"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; date -u
  $PY -c "import torch, transformers, tokenizers, safetensors; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  timeout "$VERIFY_SECONDS" $PY tools/verify_kernels.py --out "$OUT/verify_kernels.json"
  echo "verify_kernels exit $?"; } > "$OUT/verify_kernels.log" 2>&1

common=(--minutes "$MINUTES" --batch-size 64 --warmup-steps 50 --save-dtype float32
        --checkpoint-minutes 100 --eval-per-family 0 --log-every 50)
$PY tools/train_llada.py --init checkpoints/llada-small-chat --out "$WORK/small" \
    --lr 1.5e-4 --seed 7 "${common[@]}" ${SMALL_ARGS:-} > "$OUT/small.log" 2>&1 &
$PY tools/train_llada.py --from-sdar checkpoints/sdar-small-chat --out "$WORK/large12" \
    --keep-layers 0 1 2 3 4 5 6 7 8 9 10 11 --lr 3e-4 --seed 1 "${common[@]}" \
    > "$OUT/large12.log" 2>&1 &
$PY tools/train_llada.py --from-sdar checkpoints/sdar-small-chat --out "$WORK/control9" \
    --lr 3e-4 --seed 1 "${common[@]}" > "$OUT/control9.log" 2>&1 &
wait

# The small model's weights come back before the scoring, in files under 16 MiB each.
$PY tools/cast_checkpoint.py "$WORK/small" "$WORK/small-bf16" --dtype bfloat16 >> "$OUT/small.log" 2>&1 \
    && cp "$WORK/small-bf16/model.safetensors" "$OUT/small-bf16.safetensors"
$PY - "$WORK/small/model.safetensors" "$OUT/small-f32" <<'EOF' >> "$OUT/small.log" 2>&1
import sys
from safetensors.torch import load_file, save_file
weights = load_file(sys.argv[1])
shards = ({}, {})  # balanced by size: each file under the 16 MiB a returned file may have
for name in sorted(weights, key=lambda n: -weights[n].numel()):
    min(shards, key=lambda s: sum(t.numel() for t in s.values()))[name] = weights[name]
for index, shard in enumerate(shards):
    save_file(shard, f"{sys.argv[2]}-{index}.safetensors")
print("float32 weights in two shards:", [len(s) for s in shards], "tensors")
EOF

for run in small large12 control9; do
    $PY tools/train_llada.py --init "$WORK/$run" --out "$WORK/$run-scored" --max-steps 0 \
        --minutes 1 --eval-per-family "$EVAL_PER_FAMILY" --seed 0 >> "$OUT/$run.log" 2>&1 &
done
wait
