#!/usr/bin/env bash
# Same-run A/B of bench_sqlite: A = the base commit's src, B = this branch; alternating, 4 pairs.
# BASE_SRC: the base commit's src/ (git archive BASE src | tar -x -C DIR).
cd "$(dirname "$0")/.."
for i in 1 2 3 4; do
  for arm in A B; do
    if [ $arm = A ]; then SRC=$BASE_SRC; else SRC=$PWD/src; fi
    out=$(PYTHONPATH=$SRC:$PWD/tests python benchmarks/bench_sqlite.py --turns 5000 --threads 4 --rounds 1 2>&1)
    echo "$arm $(echo "$out" | grep -E '^  (ours  drain|submit \()' | tr -s ' ' | tr '\n' '|') $(echo "$out" | grep 'ratio = ours / bare(FULL)')"
  done
done
