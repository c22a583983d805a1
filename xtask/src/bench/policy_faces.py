#!/usr/bin/env python3
"""`cargo xtask bench policy`'s Python rows: the same export and observation as the Rust row
(`petite act --repeat`), called in a loop from Python through `petite.Policy` (in-process, PyO3)
and through `petite.Client` against `petite serve` on loopback.

Every call uses seed 0, so every answer must equal the first bit for bit (the Rust row's too:
the caller compares). Writes one JSON object (--json): per face the calls' wall seconds and the
part spent inside (Policy::act for the Policy, the server's own time for the Client), the open
and first call, and the first call's actions.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import time

import numpy as np

import petite


def observation(cameras: list[str], h: int, w: int, state: int) -> dict:
    # As xtask's write_observation: the same bytes as the Rust row's observation file.
    img = ((np.arange(h * w * 3) * 7) % 251).astype(np.uint8).reshape(h, w, 3)
    obs = {c: img for c in cameras}
    obs["observation.state"] = (0.1 * np.arange(state, dtype=np.float32) - 0.2).astype(np.float32)
    obs["task"] = "pick up the cube"
    return obs


def loop(call, repeat: int):
    """`repeat + 1` calls; returns (first call's seconds, first answer, walls, insides)."""
    walls, insides, first = [], [], None
    for i in range(repeat + 1):
        t0 = time.perf_counter()
        c = call()
        wall = time.perf_counter() - t0
        if i == 0:
            first = (wall, c.actions)
        else:
            walls.append(wall)
            insides.append(c.seconds if c.server_ms is None else c.server_ms / 1e3)
            if not np.array_equal(c.actions, first[1]):
                raise SystemExit(f"call {i}: the actions differ from the first call's (same seed)")
    return first[0], first[1], walls, insides


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--export", required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--petite", required=True)
    ap.add_argument("--cameras", required=True)
    ap.add_argument("--hw", required=True, help="H,W")
    ap.add_argument("--state", type=int, required=True)
    ap.add_argument("--repeat", type=int, required=True)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    h, w = (int(x) for x in a.hw.split(","))
    obs = observation(a.cameras.split(","), h, w, a.state)
    out = {}

    t0 = time.perf_counter()
    policy = petite.Policy(a.export, device=a.device, tokenizer=a.tokenizer, seed=0)
    open_s = time.perf_counter() - t0
    first, actions, walls, insides = loop(lambda: policy.act_chunk(obs, seed=0), a.repeat)
    out["python"] = {"open_s": open_s, "first_call_s": first, "walls": walls, "insides": insides,
                     "actions": actions.ravel().tolist()}
    # One copy of the weights on the device at a time.
    policy.close()
    del policy

    t0 = time.perf_counter()
    server = subprocess.Popen(
        [a.petite, "serve", "--dir", a.export, "--device", a.device, "--tokenizer", a.tokenizer,
         "--listen", "127.0.0.1:0", "--seed", "0"],
        stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        if "listening on " not in line:
            raise SystemExit(f"petite serve did not start: {line!r}")
        addr = line.split("listening on ", 1)[1].split()[0]
        client = petite.Client(addr, timeout=120.0)
        open_s = time.perf_counter() - t0
        first, actions, walls, insides = loop(lambda: client.act_chunk(obs, seed=0), a.repeat)
        out["serve"] = {"open_s": open_s, "first_call_s": first, "walls": walls, "insides": insides,
                        "actions": actions.ravel().tolist()}
        server.send_signal(signal.SIGTERM)
        rc = server.wait(timeout=120)
        if rc != 0:
            raise SystemExit(f"petite serve exited {rc} after SIGTERM")
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    with open(a.json, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
