#!/usr/bin/env bash
# Written by `cargo xtask gpu-bundle` beside run.sh (`bash .gpu/run.sh profile DIR`). Issue 50
# item 0: the exported bundle's chunk against `pi05 run`'s, kernel by kernel. ncu times each
# kernel (one metric: its duration; clocks left alone) over three chunks of each: `petite act` on
# the export `bench policy --device cuda --keep DIR` wrote, and `pi05 run --device cuda --dtype
# bf16` on the same checkpoint and inputs. Prints each run's kernel count and time and the kernels
# whose time differs most.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
B=${1:?usage: run.sh profile DIR (a bench policy --device cuda --keep DIR)}
OUT=${OUT:-/tmp}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "profile: no ncu here" >&2; exit 2; }
echo "profile: $NCU ($("$NCU" --version | tail -1))"
M=(--metrics gpu__time_duration.sum --csv --clock-control none --print-units base)
"$NCU" "${M[@]}" --log-file "$OUT/ncu-act.csv" "$here/petite" act --seed 0 --device cuda \
  --dir "$B/export" --observation "$B/observation.safetensors" --tokenizer "$B/tokenizer.json" \
  --repeat 2 --out "$OUT/profile-act.safetensors" > "$OUT/profile-act.log" 2>&1
echo "profile: act rc $?"
"$NCU" "${M[@]}" --log-file "$OUT/ncu-run.csv" "$here/petite" pi05 run --device cuda --dtype bf16 \
  --checkpoint target/pi05-full/model.safetensors --inputs "$B/inputs.safetensors" \
  --out "$OUT/profile-run.safetensors" --repeat 2 --warmup 0 > "$OUT/profile-run.log" 2>&1
echo "profile: pi05 run rc $?"
python3 "$here/ncu_sum.py" "$OUT/ncu-act.csv" "$OUT/ncu-run.csv"
