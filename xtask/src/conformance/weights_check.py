"""Conformance of petite-weights against Python's safetensors, numpy and ml_dtypes.

Run by `cargo xtask conformance` (xtask/src/conformance/weights.rs) inside a venv with
safetensors, numpy and ml_dtypes. ml_dtypes' float32 -> bfloat16 cast rounds to nearest even, as
PyTorch's `.to(torch.bfloat16)` does (both implement the same RNE on the f32 bits; NaN becomes the
quiet NaN 0x7FC0 with the sign kept by ml_dtypes); it stands in for torch to avoid a ~1 GB install.

    weights_check.py vectors OUT.bin         bf16 test vectors: u32 count, f32 bits, bf16 bits (LE)
    weights_check.py make-source SRC         a float32 checkpoint written by safetensors itself
    weights_check.py check SRC BF16 F16      petite's outputs load, and every value is exact
    weights_check.py quant-vectors OUT.bin   FP8 E4M3 and per-row INT8/FP8 quantization vectors

Quantization (petite_dtype::quant): a row's scale is float32 amax / max (max 127 or 448; 1 for a
zero row) rounded up to a bfloat16 value (ml_dtypes' RNE cast, stepped one bfloat16 up where it
fell below the quotient), a code np.clip(w / scale, -max, max) then np.rint (INT8) or ml_dtypes' float8_e4m3fn
cast (round to nearest even; it turns overflow into NaN, hence the clip first).
"""

import json
import struct
import sys
import warnings

import ml_dtypes
import numpy as np
import safetensors
from safetensors import safe_open
from safetensors.numpy import save_file

# Casting NaN inputs warns ("invalid value encountered in cast"); NaN handling is checked below.
warnings.filterwarnings("ignore", category=RuntimeWarning)

PAGE = 4096


def special_f32_bits():
    """Bit patterns where rounding is delicate."""
    s = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
         0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FBFFFFF,  # NaNs (payloads)
         0x00000001, 0x80000001, 0x007FFFFF, 0x00008000, 0x00018000,  # subnormals, tiny ties
         0x00800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF,  # normal edges, overflow
         0x3F800000, 0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF,  # ties to even, near ties
         0xBF808000, 0xBF818000, 0x3F80FFFF, 0x4049_0FDB]
    return np.array(s, dtype=np.uint32)


def vector_bits(n_random=40000, seed=5):
    rng = np.random.default_rng(seed)
    rand = rng.integers(0, 2**32, size=n_random, dtype=np.uint64).astype(np.uint32)
    # Exact ties with random high halves, both parities.
    ties = (rng.integers(0, 2**16, size=2000, dtype=np.uint64).astype(np.uint32) << 16) | 0x8000
    return np.concatenate([special_f32_bits(), rand, ties])


def bf16_bits(f32_bits):
    return f32_bits.view(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def cmd_vectors(out):
    x = vector_bits()
    y = bf16_bits(x)
    with open(out, "wb") as f:
        f.write(struct.pack("<I", len(x)))
        f.write(x.astype("<u4").tobytes())
        f.write(y.astype("<u2").tobytes())
    print(f"weights_check: wrote {len(x)} bf16 vectors to {out}")


def source_tensors():
    rng = np.random.default_rng(7)
    big = rng.standard_normal(20 * PAGE + 123).astype(np.float32)
    big[:len(special_f32_bits())] = special_f32_bits().view(np.float32)
    return {
        "enc.layers.0.weight": vector_bits(n_random=300000, seed=11).view(np.float32).reshape(-1, 2),
        "enc.layers.0.bias": big,
        "enc.scale": np.array(np.float32(0.5)),
        "steps": np.arange(7, dtype=np.int64),
        "mask": np.array([True, False, True]),
        "head.lm_head.weight": rng.standard_normal((64, 32)).astype(np.float32),
    }


def cmd_make_source(path):
    save_file(source_tensors(), path, metadata={"format": "np"})
    print(f"weights_check: wrote source {path}")


def check_layout(path, name_to_bytes):
    """Data region page-aligned; every page-multiple tensor starts on a page; every tensor starts
    on a multiple of its element size (the writer orders odd-sized tensors by element size)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    assert (8 + n) % PAGE == 0, f"{path}: data region starts at {8 + n}"
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        if end > b and (end - b) % PAGE == 0:
            assert (8 + n + b) % PAGE == 0, f"{path}: {name} starts at {8 + n + b}"
        size = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2}.get(e["dtype"], 1)
        assert (8 + n + b) % size == 0, f"{path}: {name} starts at {8 + n + b}, not {size}-aligned"
    return header


def load_all(path):
    """Loads every tensor through safetensors' own reader (full validation of the file)."""
    with open(path, "rb") as f:
        raw = f.read()
    out = {}
    for name, t in safetensors.deserialize(raw):
        dt = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32,
              "I64": np.int64, "BOOL": np.bool_, "U8": np.uint8}[t["dtype"]]
        out[name] = np.frombuffer(bytes(t["data"]), dtype=dt).reshape(t["shape"])
    # And the lazy reader petite's consumers would use.
    with safe_open(path, framework="numpy") as f:
        keys = set(f.keys())
        meta = f.metadata()
    assert keys == set(out), f"{path}: safe_open keys differ from deserialize"
    return out, meta


def cmd_check(src, out_bf16, out_f16):
    tensors = source_tensors()
    kept = {k: v for k, v in tensors.items() if "lm_head" not in k}
    for path, target, cast in [(out_bf16, "bf16", ml_dtypes.bfloat16),
                               (out_f16, "f16", np.float16)]:
        check_layout(path, None)
        got, meta = load_all(path)
        # Exactly the kept tensors: no filler or extra keys (strict loaders reject them).
        names = set(got)
        assert names == set(kept), f"{path}: tensors {sorted(names)} != {sorted(kept)}"
        checked = 0
        for name, src_v in kept.items():
            g = got[name]
            assert g.shape == src_v.shape, f"{path}: {name} shape {g.shape} != {src_v.shape}"
            if src_v.dtype == np.float32:
                want = src_v.astype(cast)
                assert g.dtype == want.dtype, f"{path}: {name} dtype {g.dtype}"
                gb, wb = g.view(np.uint16), want.view(np.uint16)
                nan = np.isnan(want.astype(np.float32))
                # Bit-exact everywhere but NaN, which must stay NaN with its sign: petite rounds
                # through `half`, which keeps a NaN's upper payload; ml_dtypes and numpy write
                # their own canonical NaNs.
                sign = (gb & 0x8000) == (wb & 0x8000)
                exact = (gb == wb) | (nan & np.isnan(g.astype(np.float32)) & sign)
                bad = np.flatnonzero(~exact.reshape(-1))
                assert bad.size == 0, (
                    f"{path}: {name}: {bad.size} elements differ from {target} RNE, first at "
                    f"{bad[0]}: f32 bits {src_v.reshape(-1)[bad[0]].view(np.uint32):#010x} -> "
                    f"{gb.reshape(-1)[bad[0]]:#06x}, want {wb.reshape(-1)[bad[0]]:#06x}")
                checked += src_v.size
            else:
                assert np.array_equal(g, src_v), f"{path}: {name} changed"
        print(f"weights_check: {path}: {len(names)} tensors load with safetensors "
              f"{safetensors.__version__}; {checked} floats bit-exact vs ml_dtypes/numpy {target} "
              f"RNE; metadata {meta}")


def quant_rows(rng):
    """Weight rows for the per-row vectors: normal rows, rows with one outlier channel (x60, as
    trained LLM weights have), a zero row, a row of FP8-subnormal magnitudes, exact INT8 ties."""
    cols = 64
    rows = [rng.standard_normal(cols).astype(np.float32) * np.float32(0.02) for _ in range(24)]
    for r in rows[::3]:
        r[rng.integers(0, cols)] *= np.float32(60.0)
    rows.append(np.zeros(cols, np.float32))
    rows.append((rng.standard_normal(cols) * 1e-6).astype(np.float32))
    # amax 127 makes the INT8 scale exactly 1: halves are ties (to even), both signs.
    ties = np.arange(cols, dtype=np.float32) - np.float32(31.5)
    ties[0] = np.float32(127.0)
    rows.append(ties)
    return np.stack(rows)


def quantize(rows, fmt):
    top = np.float32(127.0 if fmt == "int8" else 448.0)
    amax = np.abs(rows).max(axis=1)
    quotient = np.where(amax == 0, np.float32(1.0), amax / top).astype(np.float32)
    b = quotient.astype(ml_dtypes.bfloat16)
    up = (b.view(np.uint16) + np.uint16(1)).view(ml_dtypes.bfloat16)
    scale = np.where(b.astype(np.float32) < quotient, up, b).astype(np.float32)
    v = np.clip(rows / scale[:, None], -top, top).astype(np.float32)
    if fmt == "int8":
        codes = np.rint(v).astype(np.int8).view(np.uint8)
    else:
        codes = v.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return scale, codes


def cmd_quant_vectors(out):
    """u32 n, n f32 bits, n FP8 codes of them (clipped to ±448 first); 256 f32 bits, each FP8
    code's value; u32 rows, u32 cols, the rows' f32 bits, then for INT8 and FP8 the rows' f32
    scales and their codes (all little-endian)."""
    x = vector_bits(n_random=20000, seed=11)
    f = x.view(np.float32)
    # Values spread over FP8's range (its binades from 2^-10 to 2^9), ties of both parities.
    rng = np.random.default_rng(12)
    # (ldexp is exact, so the vectors are the same on any CPU; numpy's exp2 may not be.)
    spread = np.ldexp(rng.uniform(-1, 1, 20000), rng.integers(-11, 10, 20000)).astype(np.float32)
    ties = np.array([k * 2.0 ** -10 for k in range(0, 64)] + [1.0 + (2 * k + 1) / 16 for k in range(8)]
                    + [448 - 8, 448 - 16, 464 - 1e-3, 464.0, 1e-30], np.float32)
    f = np.concatenate([f, spread, ties, -ties])
    codes = np.clip(f, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    decoded = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    rows = quant_rows(np.random.default_rng(13))
    with open(out, "wb") as fh:
        fh.write(struct.pack("<I", len(f)))
        fh.write(f.view(np.uint32).astype("<u4").tobytes())
        fh.write(codes.tobytes())
        fh.write(decoded.view(np.uint32).astype("<u4").tobytes())
        fh.write(struct.pack("<II", *rows.shape))
        fh.write(rows.view(np.uint32).astype("<u4").tobytes())
        for fmt in ("int8", "fp8"):
            scale, qc = quantize(rows, fmt)
            fh.write(scale.view(np.uint32).astype("<u4").tobytes())
            fh.write(qc.tobytes())
    print(f"weights_check: wrote {len(f)} FP8 vectors, 256 codes and {rows.shape[0]}x{rows.shape[1]} "
          f"quantized rows (ml_dtypes {ml_dtypes.__version__}) to {out}")


def main():
    cmd, *args = sys.argv[1:]
    {"vectors": cmd_vectors, "make-source": cmd_make_source, "check": cmd_check,
     "quant-vectors": cmd_quant_vectors}[cmd](*args)


if __name__ == "__main__":
    main()
