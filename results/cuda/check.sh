#!/usr/bin/env bash
# The CUDA path end to end, as results/cuda/ and results/bench/ record it. On a GPU machine:
#   OUT=DIR bash results/cuda/check.sh   (each file in DIR starts with its command and the machine)
set -u
export PYTHONUNBUFFERED=1
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name(0) + ', torch ' + torch.__version__)")
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}  # a copied tree: give COMMIT
head="# one $gpu, commit $commit, $(date -u +%F)"
record() {  # record FILE CMD...: run CMD, write its command, the machine, its console and rc to FILE
    local file=$1; shift
    { echo "# $*"; echo "$head"; "$@" 2>&1; echo "rc $?"; } > "$OUT/$file"
    tail -3 "$OUT/$file"
}
record cuda-test.txt python3 -m pytest -q -p no:cacheprovider tests/test_engine.py -k cuda
record bench-r1-compiled.txt python3 scripts/bench.py --shape r1 --device cuda --compile \
    --batch 32 --new-tokens 256 --delta 64 --block 16 --repeat 1 --replay-batch 4
record train-step.txt python3 train.py --task countdown --device cuda --steps 1 --eval-every 1 \
    --out runs/cuda-step --overwrite
cp runs/cuda-step/log.jsonl "$OUT/train-step.log.jsonl"
record train-step-compiled.txt python3 train.py --task countdown --device cuda --compile \
    --steps 1 --eval-every 1 --eviction-draws 4 --out runs/cuda-step-compiled --overwrite
record eval.txt python3 scripts/eval.py --model runs/cuda-step/checkpoint --device cuda \
    --policy ngc bound task-rule none --eviction-rate 0.5 --out "$OUT/eval.jsonl"
