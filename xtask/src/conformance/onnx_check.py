"""ONNX tier: every engine model passes onnx.checker (full check); the f32 twin, run by ONNX
Runtime on CPU, matches the reference executor's outputs for that engine.

usage: onnx_check.py CASES_DIR   (written by `cargo run -p petite --example onnx_cases`)
"""
import json
import struct
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

# |ORT − reference| / max(1, |reference|). Both sides are computed in this run, on this CPU, and
# both pick kernels per CPU (ORT's MLAS: AVX2/AVX-512/AMX paths; petite's `gemm`: FMA or not), so
# what this covers is two f32 summation orders over K ≤ 16384 terms (~1e-6 relative), not a
# same-machine assumption; bf16 outputs additionally get their 1–2-ulp rounding flips excluded.
TOL = 1e-4


def read_safetensors(path):
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    out = {}
    dtypes = {}
    for name, e in header.items():
        if name == "__metadata__" or name.startswith("__petite_pad_"):
            continue
        b, end = e["data_offsets"]
        buf = data[b:end]
        dt = e["dtype"]
        if dt == "BF16":
            a = (np.frombuffer(buf, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            a = np.frombuffer(
                buf,
                dtype={"F32": np.float32, "I64": np.int64, "I32": np.int32, "U8": np.uint8, "BOOL": np.bool_}[dt],
            )
        out[name] = a.reshape(e["shape"]).copy()
        dtypes[name] = dt
    return out, dtypes


def main():
    root = Path(sys.argv[1])
    cases = [l for l in (root / "manifest.txt").read_text().split("\n") if l]
    worst = 0.0
    failures = []
    ulp_flips = [0]
    for c in cases:
        for flavor in ("f32twin", "trt"):
            onnx.checker.check_model(str(root / f"{c}.{flavor}.onnx"), full_check=True)
        io, dtypes = read_safetensors(root / f"{c}.io.safetensors")
        sess = ort.InferenceSession(str(root / f"{c}.f32twin.onnx"), providers=["CPUExecutionProvider"])
        feeds = {}
        for i in sess.get_inputs():
            v = io["in/" + i.name]
            if i.type == "tensor(float)":
                v = v.astype(np.float32)
            feeds[i.name] = v
        names = [o.name for o in sess.get_outputs()]
        got = dict(zip(names, sess.run(names, feeds)))
        case_worst = 0.0
        for n, g in got.items():
            want = io["out/" + n]
            if want.dtype == np.bool_ or want.dtype.kind in "iu":
                if not np.array_equal(g.astype(want.dtype), want):
                    failures.append(f"{c}: output {n} differs")
                continue
            g = g.astype(np.float32)
            err = np.abs(g - want) / np.maximum(1.0, np.abs(want))
            if dtypes["out/" + n] == "BF16":
                # A bf16 output rounds an f32 result: where ORT's f32 and the reference's f32
                # differ by a hair across a rounding boundary, the two round a bf16 ulp or two apart (sin/cos of large time arguments).
                # Those elements are counted and excluded; everything else must be within TOL.
                gb = g.view(np.uint32) >> 16
                wb = want.view(np.uint32) >> 16
                flip = (np.abs(gb.astype(np.int64) - wb.astype(np.int64)) <= 2) & (err > TOL)
                nflip = int(flip.sum())
                if nflip:
                    print(f"  {c}: output {n}: {nflip} of {g.size} bf16 elements 1-2 ulps apart")
                    ulp_flips[0] += nflip
                err = np.where(flip, 0.0, err)
            e = float(err.max()) if err.size else 0.0
            case_worst = max(case_worst, e)
            if not e <= TOL:
                failures.append(f"{c}: output {n}: max error {e:.3g} > {TOL}")
        worst = max(worst, case_worst)
        print(f"{c}: checker ok (both flavours), ORT max error {case_worst:.3g}")
    print(
        f"{len(cases)} engines, worst error {worst:.3g} (tolerance {TOL}, |a-b|/max(1,|b|)), "
        f"{ulp_flips[0]} bf16 elements 1-2 ulps apart"
    )
    if failures:
        print("\n".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
