"""Runs `petite export --backend onnx`'s pi05.onnx in ONNX Runtime (CPU): one session.run for the
whole policy (prefix, ten Euler steps) on an inputs file, as any user of the model would.

Usage: run_pi05_onnx.py DIR --inputs INPUTS.safetensors [--expected EXPECTED.safetensors]
           [--key actions] [--tol 1e-4] [--check] [--threads N] [--no-prepack] [--runs N]
           [--print-actions]
DIR holds pi05.onnx, pi05.onnx.data and pi05.onnx.json (the interface, checked against the
inputs file first: a name, dtype or shape the model does not take is one line naming it).
INPUTS holds images, image_masks, tokens, token_mask, noise (testdata/pi05/README.md), and
optionally rtc_prev, rtc_weights, rtc_steps (real-time chunking; zeros when absent).
--check: onnx.checker.check_model(full_check=True) first (needs the onnx package).
--probe-bf16: for a bf16 model, after --check, confirm ONNX Runtime's CPU provider refuses it
(NOT_IMPLEMENTED; exit 0), which is what `petite verify`'s refusal states (exit 1 if it ran).
--expected: max |actions - golden[key]| <= tol, folded as petite's max_abs_diff does (a NaN or
+-inf on either side, or a length mismatch, fails; never a number). --no-prepack: ONNX
Runtime's session.disable_prepacking (no packed copy of each weight per node that reads it).
Prints one JSON line: seconds to create the session and per run, peak RSS of this process, ORT's
version, the error against --expected (with --print-actions also the actions, flat f32: `petite
verify` embeds this script and reads them). Exit 2: bad input (one line on stderr).
"""
import json
import os
import resource
import struct
import sys
import time

import numpy as np

DT = {"F32": np.float32, "I64": np.int64, "I32": np.int32, "U8": np.uint8, "BOOL": np.bool_}
PETITE = {"f32": np.float32, "i64": np.int64, "u8": np.uint8}


def fail(msg):
    print(f"run_pi05_onnx: {msg}", file=sys.stderr)
    sys.exit(2)


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8:8 + n])
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        if v["dtype"] not in DT:
            fail(f"{path}: tensor `{k}`: dtype {v['dtype']} is not one the model takes")
        a, b = v["data_offsets"]
        out[k] = np.frombuffer(data[8 + n + a:8 + n + b], dtype=DT[v["dtype"]]).reshape(v["shape"])
    return out


def max_abs_diff(actual, expected):
    """petite_reference::compare::max_abs_diff: an error (str) or the largest |a - e| (f32)."""
    a = np.asarray(actual, dtype=np.float32).ravel()
    e = np.asarray(expected, dtype=np.float32).ravel()
    if a.size != e.size:
        return None, f"length mismatch: {a.size} actual values vs {e.size} expected"
    for side, x in (("actual", a), ("expected", e)):
        bad = np.flatnonzero(~np.isfinite(x))
        if bad.size:
            return None, f"non-finite value {x[bad[0]]} at index {bad[0]} of the {side} values"
    if a.size == 0:
        return 0.0, None
    return float(np.float32(np.abs(a.astype(np.float64) - e.astype(np.float64)).max())), None


def probe_bf16(model, check_s):
    """What `petite verify` assumes of a bf16 model: ONNX Runtime's CPU provider cannot create a
    session for it (NOT_IMPLEMENTED). Exit 0 when so; 1 when ORT ran it (the refusal is stale)."""
    import onnxruntime as ort

    try:
        ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001  (ORT raises its own pybind types)
        msg = str(e).strip().splitlines()[-1]
        print(json.dumps({"runtime": f"onnxruntime {ort.__version__}", "checker_s": check_s,
                          "bf16_session": "refused", "error": msg}))
        sys.exit(0 if "NOT_IMPLEMENTED" in msg else 1)
    print(json.dumps({"runtime": f"onnxruntime {ort.__version__}", "bf16_session": "created"}))
    sys.exit(1)


def arg(name, default=None):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def main():
    d = sys.argv[1]
    model = os.path.join(d, "pi05.onnx")
    spec_path = os.path.join(d, "pi05.onnx.json")
    if not os.path.exists(spec_path):
        fail(f"{spec_path}: missing (written by `petite export --backend onnx` next to pi05.onnx)")
    with open(spec_path) as f:
        spec = json.load(f)
    check_s = None
    if "--check" in sys.argv:
        import onnx

        t = time.perf_counter()
        onnx.checker.check_model(model, full_check=True)
        check_s = time.perf_counter() - t
    if spec.get("dtype") != "f32":
        if "--probe-bf16" in sys.argv:
            probe_bf16(model, check_s)
        fail(f"{model} is a {spec.get('dtype')} model: ONNX Runtime's CPU provider has no bf16 "
             "Gemm/MatMul kernels; run it with TensorRT, or export --dtype f32 for ONNX Runtime")
    inputs_path = arg("--inputs")
    ins = read_safetensors(inputs_path)
    feeds = {}
    for i in spec["inputs"]:
        name, shape, want = i["name"], list(i["shape"]), PETITE[i["dtype"]]
        if name.startswith("rtc_") and name not in ins:
            # Real-time chunking's guidance left out: zeros, the plain chunk.
            ins[name] = np.zeros(shape, want)
        if name == "rtc_weights" and name in ins and ins[name].size == int(np.prod(shape)):
            ins[name] = ins[name].reshape(shape)
        if name not in ins:
            fail(f"{inputs_path}: no tensor `{name}` ({i['dtype']} {shape}), which the model takes")
        v = ins[name]
        if v.dtype == np.bool_ and want == np.uint8:
            v = v.astype(np.uint8)
        if v.dtype != want or list(v.shape) != shape:
            fail(f"{inputs_path}: tensor `{name}`: the model takes {i['dtype']} {shape}, found "
                 f"{v.dtype} {list(v.shape)} (exported with another config?)")
        feeds[name] = np.ascontiguousarray(v)
    import onnxruntime as ort

    so = ort.SessionOptions()
    if arg("--threads"):
        so.intra_op_num_threads = int(arg("--threads"))
    if "--no-prepack" in sys.argv:
        so.add_session_config_entry("session.disable_prepacking", "1")
    t = time.perf_counter()
    sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    create_s = time.perf_counter() - t
    rss_after_create = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out_name = spec["outputs"][0]["name"]
    runs = []
    actions = None
    for _ in range(int(arg("--runs", "1"))):
        t = time.perf_counter()
        (actions,) = sess.run([out_name], feeds)
        runs.append(time.perf_counter() - t)
    want_shape = list(spec["outputs"][0]["shape"])
    res = {
        "runtime": f"onnxruntime {ort.__version__} CPUExecutionProvider",
        "threads": so.intra_op_num_threads,
        "prepacking": "--no-prepack" not in sys.argv,
        "checker_s": check_s,
        "session_s": create_s,
        "run_s": runs,
        "peak_rss_bytes_after_session": rss_after_create,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "shape": list(actions.shape),
        "max_abs_actions": float(np.abs(actions).max()) if np.all(np.isfinite(actions)) else None,
    }
    ok = list(actions.shape) == want_shape
    if not ok:
        res["error"] = f"actions shape {list(actions.shape)} != the interface's {want_shape}"
    if arg("--expected"):
        key = arg("--key", "actions")
        tol = float(arg("--tol", "1e-4"))
        exp = read_safetensors(arg("--expected"))[key]
        err, why = max_abs_diff(actions, exp)
        res.update({"golden": key, "max_abs_err_actions": err, "tol": tol})
        if why is not None:
            res["error"] = why
            ok = False
        elif not err <= tol:
            ok = False
    res["ok"] = ok
    if "--print-actions" in sys.argv:
        # JSON has no NaN/inf: those travel as the strings "nan", "inf", "-inf" (petite parses
        # them back, and its max_abs_diff then fails naming the value and its index).
        res["actions"] = [float(x) if np.isfinite(x) else str(x)
                          for x in np.asarray(actions, dtype=np.float32).ravel()]
    print(json.dumps(res))
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
