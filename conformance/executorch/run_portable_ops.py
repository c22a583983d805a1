"""Runs petite-portable's per-op cases in ExecuTorch's runtime (executorch-numpy-runtime 1.4.0).

Usage: run_portable_ops.py CASES_DIR [--runtime numpy|torch]   (written by `cargo test -p petite-portable --test op_cases`)
Each case (manifest.json) is loaded and run in a subprocess (older runtimes can crash on bad
input); outputs are compared with the reference executor's. bf16 travels as uint16 bits.
Tolerances: f32 |a-b| <= 2e-5 + 2e-5|b| (kernel order of operations differs from the reference);
bf16 within 1 bf16 ulp of the reference (|a-b| <= 2^-7 |b| + 1e-6, plus a case's `bf16_abs_tol`:
portable mm/addmm round in bf16 inside the kernel); integers and bools exact. The expected
values are the reference executor's, written by the same `cargo test` run on the same CPU, so
the bounds cover two implementations' summation orders, not a cross-machine difference.
"""
import json
import os
import subprocess
import sys

import numpy as np


from et_runner import Runner, runtime_arg  # noqa: E402  (beside this script)


def bf16_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def compare(case, name, dtype, got, want, bf16_abs_tol=0.0):
    if got.shape != want.shape:
        return f"{case} {name}: shape {got.shape} != {want.shape}"
    if dtype == "bf16":
        g, w = bf16_to_f32(got.view(np.uint16)), bf16_to_f32(want)
        tol = 2.0 ** -7 * np.abs(w) + 1e-6 + bf16_abs_tol
    elif dtype in ("f32", "f16"):
        g, w = got.astype(np.float64), want.astype(np.float64)
        tol = 2e-5 + 2e-5 * np.abs(w)
    else:
        if not np.array_equal(got, want):
            return f"{case} {name}: {got.tolist()} != {want.tolist()}"
        return None
    err = np.abs(g.astype(np.float64) - w.astype(np.float64))
    bad = ~(err <= tol)
    if bad.any():
        i = int(np.argmax(np.where(bad, err, -1)))
        return (f"{case} {name}: max err {err.max():.3g} at flat {i}: "
                f"got {g.flat[i]} want {w.flat[i]}")
    return None


def run_one(d, case, runtime):
    method = Runner(os.path.join(d, case["pte"]), runtime)
    ins = [np.load(os.path.join(d, i["file"])) for i in case["inputs"]]
    outs = method(ins, [i["dtype"] == "bf16" for i in case["inputs"]])
    errs = []
    worst = 0.0
    for spec, got in zip(case["outputs"], outs):
        want = np.load(os.path.join(d, spec["file"]))
        got = np.asarray(got)
        e = compare(case["name"], spec["name"], spec["dtype"], got, want,
                    case.get("bf16_abs_tol", 0.0))
        if e:
            errs.append(e)
        elif spec["dtype"] in ("f32", "bf16") and want.size:
            g = bf16_to_f32(got.view(np.uint16)) if spec["dtype"] == "bf16" else got
            w = bf16_to_f32(want) if spec["dtype"] == "bf16" else want
            worst = max(worst, float(np.abs(g.astype(np.float64) - w).max()))
    if len(outs) != len(case["outputs"]):
        errs.append(f"{case['name']}: {len(outs)} outputs, expected {len(case['outputs'])}")
    print(json.dumps({"errors": errs, "max_abs_err": worst}))


def main():
    runtime = runtime_arg()
    if sys.argv[1] == "--one":
        d = sys.argv[2]
        cases = json.load(open(os.path.join(d, "manifest.json")))
        run_one(d, next(c for c in cases if c["name"] == sys.argv[3]), runtime)
        return
    d = sys.argv[1]
    cases = json.load(open(os.path.join(d, "manifest.json")))
    failed = []
    for case in cases:
        r = subprocess.run([sys.executable, __file__, "--one", d, case["name"], "--runtime", runtime],
                           capture_output=True, text=True)
        if r.returncode != 0:
            failed.append(f"{case['name']}: runtime exited {r.returncode}: {r.stderr.strip()[-800:]}")
            print(f"FAIL {case['name']} (exit {r.returncode})")
            continue
        res = json.loads(r.stdout.strip().splitlines()[-1])
        if res["errors"]:
            failed.extend(res["errors"])
            print(f"FAIL {case['name']}: {res['errors'][0]}")
        else:
            print(f"ok   {case['name']:28s} max|err| {res['max_abs_err']:.3g}  ops {len(case['operators'])}")
    if failed:
        print(f"portable ops: {len(failed)} failure(s) of {len(cases)} cases", file=sys.stderr)
        for f in failed:
            print("  " + f, file=sys.stderr)
        sys.exit(1)
    print(f"portable ops ({runtime}): all {len(cases)} cases match the reference executor in ExecuTorch's runtime")


if __name__ == "__main__":
    main()
