"""Sums two ncu --csv logs (gpu__time_duration.sum) by kernel name and prints the kernels whose
time differs most between them (written by `cargo xtask gpu-bundle` beside profile_bundle.sh)."""
import csv
import re
import sys
from collections import defaultdict

SCALE = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}


def load(path):
    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]
    rows = []
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = re.sub(r"\(.*", "", r["Kernel Name"])[:70]
        value = float(r["Metric Value"].replace(",", ""))
        rows.append((name, value * SCALE.get(r.get("Metric Unit", "ns"), 1e-6)))
    return rows


def by_name(rows):
    d = defaultdict(lambda: [0, 0.0])
    for n, v in rows:
        d[n][0] += 1
        d[n][1] += v
    return d


a, b = load(sys.argv[1]), load(sys.argv[2])
for tag, rows in (("bundle (act)", a), ("pi05 run", b)):
    print(f"{tag}: {len(rows)} kernels, {sum(v for _, v in rows):.3f} ms in all (three chunks)")
da, db = by_name(a), by_name(b)
names = sorted(set(da) | set(db), key=lambda n: -abs(da[n][1] - db[n][1]))
print(f"{'kernel':70} {'n bundle':>8} {'ms bundle':>10} {'n run':>8} {'ms run':>10}")
for n in names[:40]:
    print(f"{n:70} {da[n][0]:8d} {da[n][1]:10.3f} {db[n][0]:8d} {db[n][1]:10.3f}")
