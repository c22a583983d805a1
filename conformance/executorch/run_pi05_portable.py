"""Runs pi0.5 as portable ExecuTorch programs and compares with lerobot's golden actions.

Usage: run_pi05_portable.py CASE_DIR PTE_DIR [--tol 1e-4] [--runtime numpy|torch] [--key actions]
CASE_DIR holds a golden case (inputs.safetensors, expected.safetensors; testdata/pi05/README.md).
PTE_DIR holds timesteps.pte, prefix.pte, step.pte (from `petite lower`), each with its .pte.json
(input/output names, dtypes and shapes in call order). The driver runs the timestep table once,
the prefix once and the step `steps` times in executorch-numpy-runtime (portable kernels only),
exactly as `petite pi05 run` orchestrates them, and checks max |actions - golden| <= tol.
Prints one JSON line with the errors (actions, and prefix K/V against lerobot's intermediates).
"""
import json
import os
import struct
import sys

import numpy as np


from et_runner import Runner, runtime_arg  # noqa: E402  (beside this script)

DT = {"F32": np.float32, "I64": np.int64, "I32": np.int32, "U8": np.uint8, "BOOL": np.bool_,
      "F16": np.float16, "BF16": np.uint16}
PETITE = {"f32": np.float32, "i64": np.int64, "i32": np.int32, "u8": np.uint8, "bool": np.bool_,
          "f16": np.float16, "bf16": np.uint16}


def read_safetensors(path):
    data = open(path, "rb").read()
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        out[k] = np.frombuffer(data[base + a:base + b], dtype=DT[v["dtype"]]).reshape(v["shape"])
    return out


def load(runtime, pte_dir, name):
    spec = json.load(open(os.path.join(pte_dir, name + ".pte.json")))
    return spec, Runner(os.path.join(pte_dir, name + ".pte"), runtime)


def call(spec, method, feed):
    args = []
    for i in spec["inputs"]:
        a = np.asarray(feed[i["name"]]).astype(PETITE[i["dtype"]]).reshape(i["shape"])
        args.append(np.ascontiguousarray(a))
    outs = method(args, [i["dtype"] == "bf16" for i in spec["inputs"]])
    return {o["name"]: np.asarray(v) for o, v in zip(spec["outputs"], outs)}


def main():
    et = runtime_arg()
    case_dir, pte_dir = sys.argv[1], sys.argv[2]
    key = sys.argv[sys.argv.index("--key") + 1] if "--key" in sys.argv else "actions"
    tol = float(sys.argv[sys.argv.index("--tol") + 1]) if "--tol" in sys.argv else 1e-4
    inputs = read_safetensors(os.path.join(case_dir, "inputs.safetensors"))
    expected = read_safetensors(os.path.join(case_dir, "expected.safetensors"))

    ts_spec, ts = load(et, pte_dir, "timesteps")
    table = call(ts_spec, ts, {})["timestep_table"].astype(np.float32)
    pre_spec, pre = load(et, pte_dir, "prefix")
    prefix = call(pre_spec, pre, inputs)
    kv_err = 0.0
    for k, v in prefix.items():
        if k in expected:
            if v.dtype == np.uint16:  # bf16 bits (petite has no u16 dtype)
                v = (v.astype(np.uint32) << 16).view(np.float32)
            kv_err = max(kv_err, float(np.abs(v.astype(np.float64).reshape(expected[k].shape)
                                              - expected[k]).max()))
    step_spec, step = load(et, pte_dir, "step")
    x = inputs["noise"].astype(np.float32)
    steps = table.shape[0]
    for k in range(steps):
        feed = dict(prefix)
        feed["x_t"] = x
        feed["time_row"] = table[k]
        x = call(step_spec, step, feed)["x_next"].astype(np.float32)
    err = float(np.abs(x.astype(np.float64) - expected[key]).max())
    res = {"case": os.path.basename(os.path.normpath(case_dir)), "runtime": et, "steps": steps,
           "golden": key, "max_abs_err_actions": err, "max_abs_err_prefix_kv": kv_err,
           "max_abs_actions": float(np.abs(expected["actions"]).max()), "tol": tol,
           "ok": bool(err <= tol)}
    print(json.dumps(res))
    if not res["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
