"""Runs pi0.5 as portable ExecuTorch programs: the timestep table once, the prefix once and the
step `steps` times, exactly as `petite pi05 run` orchestrates them, in ExecuTorch's runtime.

Usage: run_pi05_portable.py PTE_DIR --inputs INPUTS.safetensors [--expected EXPECTED.safetensors]
           [--key actions] [--tol 1e-4] [--runtime numpy|torch] [--print-actions]
PTE_DIR is either what `petite export --backend portable` writes (prefix.pte; step.pte with
methods forward and timestep_table) or what `petite lower` writes (timesteps.pte, prefix.pte,
step.pte); each .pte has a .pte.json naming its methods' inputs and outputs (dtypes, shapes, call
order). INPUTS holds images, image_masks, tokens, token_mask, noise (testdata/pi05/README.md), and
optionally rtc_prev, rtc_weights, rtc_steps (real-time chunking; zeros when absent).
With --expected (a golden case's expected.safetensors) it checks max |actions - golden[key]| <= tol
and the prefix K/V against lerobot's intermediates. Prints one JSON line (with the actions, flat
f32, under --print-actions: `petite verify` embeds this script and reads them).
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


def bf16_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x):
    """Round to nearest even, as petite and PyTorch do (NaN -> 0x7FC0)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), r)


class Value:
    """A tensor between methods, tagged with its petite dtype (bf16 travels as uint16 bits)."""

    def __init__(self, array, dtype):
        self.a, self.dtype = np.asarray(array), dtype

    def as_(self, dtype):
        if dtype == self.dtype:
            return self.a
        x = bf16_to_f32(self.a) if self.dtype == "bf16" else self.a
        return f32_to_bf16(x) if dtype == "bf16" else x.astype(PETITE[dtype])

    def f32(self):
        return self.as_("f32").astype(np.float32)


class Method:
    def __init__(self, runtime, pte, spec):
        self.spec, self.run = spec, Runner(pte, runtime, spec["method"])

    def __call__(self, feed):
        args = []
        for i in self.spec["inputs"]:
            v = feed[i["name"]]
            v = v if isinstance(v, Value) else Value(v, "f32" if v.dtype == np.float32 else
                                                     {np.dtype(t): n for n, t in PETITE.items()
                                                      if n != "bf16"}[v.dtype])
            args.append(np.array(v.as_(i["dtype"]).reshape(i["shape"]), order="C", copy=True))
        outs = self.run(args, [i["dtype"] == "bf16" for i in self.spec["inputs"]])
        return {o["name"]: Value(np.asarray(v).reshape(o["shape"]), o["dtype"])
                for o, v in zip(self.spec["outputs"], outs)}


def methods(runtime, pte_dir, name):
    pte = os.path.join(pte_dir, name + ".pte")
    spec = json.load(open(pte + ".json"))
    specs = spec["methods"] if "methods" in spec else [spec]
    return {s["method"]: Method(runtime, pte, s) for s in specs}


def arg(flag, default=None):
    return sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv else default


def main():
    et = runtime_arg()
    pte_dir = sys.argv[1]
    inputs = read_safetensors(arg("--inputs"))
    expected = read_safetensors(arg("--expected")) if "--expected" in sys.argv else None
    key = arg("--key", "actions")
    tol = float(arg("--tol", "1e-4"))

    step = methods(et, pte_dir, "step")
    if "timestep_table" in step:  # petite export --backend portable
        table = step["timestep_table"]({})["timestep_table"].f32()
    else:  # petite lower
        table = methods(et, pte_dir, "timesteps")["forward"]({})["timestep_table"].f32()
    prefix = methods(et, pte_dir, "prefix")["forward"](inputs)
    x = Value(inputs["noise"].astype(np.float32), "f32")
    steps = table.shape[0]
    # Real-time chunking's guidance (petite-policy/2 step programs): from the inputs file, or
    # zeros (the plain chunk).
    chunk = inputs["noise"].shape[0]
    rtc_prev = inputs.get("rtc_prev", np.zeros_like(inputs["noise"], np.float32))
    rtc_weights = inputs.get("rtc_weights", np.zeros(chunk, np.float32)).reshape(chunk, 1)
    rtc_steps = inputs.get("rtc_steps", np.zeros((steps, 2), np.float32))
    for k in range(steps):
        feed = dict(prefix)
        feed["x_t"] = x
        feed["time_row"] = Value(table[k], "f32")
        feed["rtc_prev"] = Value(rtc_prev.astype(np.float32), "f32")
        feed["rtc_weights"] = Value(rtc_weights.astype(np.float32), "f32")
        feed["rtc_step"] = Value(rtc_steps[k].astype(np.float32), "f32")
        x = step["forward"](feed)["x_next"]
    actions = x.f32()
    res = {"runtime": et, "steps": steps, "pte_dir": pte_dir,
           "shape": list(actions.shape), "max_abs_actions": float(np.abs(actions).max())}
    if expected is not None:
        kv_err = 0.0
        for k, v in prefix.items():
            if k in expected:
                kv_err = max(kv_err, float(np.abs(v.f32().astype(np.float64).reshape(
                    expected[k].shape) - expected[k]).max()))
        # Shapes must agree exactly (numpy would broadcast [1, n] against [m, n]); a NaN makes
        # `err` NaN and `err <= tol` False.
        if tuple(actions.shape) != tuple(expected[key].shape):
            raise SystemExit(f"actions shape {list(actions.shape)} != golden {key} {list(expected[key].shape)}")
        err = float(np.abs(actions.astype(np.float64) - expected[key]).max())
        res.update({"golden": key, "max_abs_err_actions": err, "max_abs_err_prefix_kv": kv_err,
                    "tol": tol, "ok": bool(err <= tol)})
    if "--print-actions" in sys.argv:
        res["actions"] = [float(v) for v in actions.reshape(-1)]
    print(json.dumps(res))
    if expected is not None and not res["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
