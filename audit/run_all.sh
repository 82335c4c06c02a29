#!/usr/bin/env bash
# Runs every audit check one after another (one heavy job at a time); outputs in audit/out/.
# Needs root (tmpfs mounts) and the project's virtualenv active.
cd "$(dirname "$0")/.." && mkdir -p audit/out
export PYTHONPATH=$PWD/src:$PWD/tests
./audit/check1_fresh.sh > audit/out/check1.txt 2>&1
python audit/check2_sigkill.py > audit/out/check2a.txt 2>&1
ROUND_SLEEP=3 python audit/check2_sigkill.py > audit/out/check2b.txt 2>&1
SUBMIT_VIA=http NAMED=0 ROUND_SLEEP=0.5 python audit/check2_sigkill.py > audit/out/check2c.txt 2>&1
python audit/check3_diskfull.py > audit/out/check3.txt 2>&1
[ -n "${BASE_SRC:-}" ] && python audit/check3c_upgrade_big_wal.py > audit/out/check3c.txt 2>&1
python audit/check3b_intake_full.py > audit/out/check3b.txt 2>&1
python audit/check4_intake.py > audit/out/check4.txt 2>&1
python audit/check4b_many_slow.py > audit/out/check4b.txt 2>&1
python audit/check5_admission.py > audit/out/check5.txt 2>&1
./audit/check6_start_on_full.sh > audit/out/check6.txt 2>&1
python audit/check7_api_bodies.py > audit/out/check7.txt 2>&1
python audit/check8_sigterm_full.py > audit/out/check8.txt 2>&1
echo done > audit/out/DONE
