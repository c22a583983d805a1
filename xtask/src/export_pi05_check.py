"""ExecuTorch's own deserializer on an export's .pte files (run by `cargo xtask export-pi05` when
the conformance venv target/venv-pte-full exists): `deserialize_pte_binary` (executorch 1.5.1) must
read prefix.pte and step.pte, and find the methods, delegates and named-data keys report.json lists,
each engine once. The files are mapped, not read, so a multi-GiB export does not need the RAM."""

import json
import mmap
import os
import sys

from executorch.exir._serialize._program import deserialize_pte_binary


def main(out_dir):
    report = json.load(open(os.path.join(out_dir, "report.json")))
    for prog, methods in (("prefix", ["forward"]), ("step", ["forward", "timestep_table"])):
        path = os.path.join(out_dir, f"{prog}.pte")
        with open(path, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            p = deserialize_pte_binary(data)
        names = [ep.name for ep in p.program.execution_plan]
        if names != methods:
            sys.exit(f"{path}: methods {names}, expected {methods}")
        fwd = p.program.execution_plan[0]
        engines = [e["name"] for e in report["programs"][prog]["engines"]]
        if len(fwd.delegates) != len(engines):
            sys.exit(f"{path}: {len(fwd.delegates)} delegates, report lists {len(engines)} engines")
        # executorch moves named data out of the program into a NamedDataStoreOutput.
        keys = list(getattr(p.named_data, "pte_data", {}) or {}) if p.named_data else []
        if sorted(keys) != sorted(engines) or len(set(keys)) != len(keys):
            sys.exit(f"{path}: named data {keys} != engines {engines}")
        print(f"executorch deserialize_pte_binary: {path}: methods {names}, "
              f"{len(fwd.delegates)} delegates ({fwd.delegates[0].id}), each engine once")


if __name__ == "__main__":
    main(sys.argv[1])
