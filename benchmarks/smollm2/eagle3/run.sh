#!/usr/bin/env bash
# How the bundled EAGLE-3 drafter for smollm2-135m was made and measured (issue 13), in order.
# Run from the repository root with .venv active, on a quiet machine (no other job: 2-thread
# torch slows 8-20x when another process spins).
set -euo pipefail
OUT=benchmarks/smollm2/eagle3

# 1. training prompts (committed as data/distill-prompts.jsonl) and the target's answers + features
python scripts/make_distill_prompts.py
# (the bundled drafter's run was stopped after 1,820 prompts, 36 minutes, to leave time to train;
# the command resumes where it stopped)
specdecode distill-data --target smollm2-135m --prompts data/distill-prompts.jsonl \
    --out distill/smollm2 --chat --max-new-tokens 200 --temperature 0,0,1 --batch-size 32

# 2. the drafter (resumable: rerun to continue)
specdecode train-heads --method eagle3 --target smollm2-135m --data distill/smollm2 \
    --out models/smollm2-135m/eagle3 --epochs 4 --max-minutes 25 --lr 3e-4

# 3. Spec-Bench, 6 prompts per category (MT-bench: six of its eight kinds), bf16, chat, 128 tokens;
# k = 2 was the fastest chain in a sweep (NOTES.md)
common="--target smollm2-135m --prompts spec-bench --limit 6 --chat --dtype bf16 --no-transformers --no-invariance --k 2"
specdecode bench $common --method eagle3 --temperature 0 --out $OUT/greedy --json > /dev/null
specdecode bench $common --method auto --temperature 0 --out $OUT/auto --json > /dev/null
specdecode bench $common --method eagle3 --temperature 1 --out $OUT/t1 --json > /dev/null
python -c "from specdecode.train.model_card import write_eagle3_card as w; print(w('models/smollm2-135m/eagle3', ['$OUT/greedy/model-bench.json', '$OUT/t1/model-bench.json']))"
