#!/usr/bin/env bash
# The GPU check (issue: any device): greedy identity of every method, the two-token distribution
# test and its negative control, then `specdecode bench --quick` on CUDA. Run from the
# repository root on a machine with a GPU: bash scripts/gpu_check.sh [cuda:N]
set -euo pipefail
DEVICE="${1:-cuda}"
OUT="${OUT:-out/gpu_check}"
mkdir -p "$OUT"
PY="${PY:-.venv/bin/python}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
"$PY" scripts/gpu_check.py --device "$DEVICE" | tee "$OUT/check.json"
"$PY" -m specdecode.cli bench --quick --json --no-progress --device "$DEVICE" --out "$OUT/bench" > "$OUT/bench.json"
"$PY" - "$OUT/bench.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for t in d["targets"]:
    print(f"{t['target'][:70]:70s} worst {t['worst']:.3f} median {t['median']:.3f} met {t['met']}")
PY
