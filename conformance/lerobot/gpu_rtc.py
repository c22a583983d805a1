#!/usr/bin/env python3
"""lerobot's real-time-chunking goldens through petite's Python package on a GPU (the gpu tier).

For one case folder of the gpu-bundle's policy goldens (make_policy_folders.py and
make_rtc_goldens.py: `loop.safetensors`, `rtc.safetensors`) and an f32 export of its policy
folder, every RTC golden goes through
  - `petite.Policy(EXPORT, device="cuda")` (in process), and
  - `petite.Client` against `petite serve --device cuda` of the same export on loopback,
with lerobot's keywords (`prev_chunk_left_over`, `inference_delay`, `execution_horizon`,
`prefix_attention_schedule` by name, `max_guidance_weight`): `predict_action_chunk` (model
space) and `act` (after the postprocessor) within BOUND × max(1, |a|) of lerobot's f32 values.
A NaN, a shape or dtype mismatch fails (`python_policy.worst`). lerobot itself is not needed here (the goldens carry its
values), so this runs on the device machine's Python with numpy and safetensors.

Prints one line per face and a JSON summary (`gpu-rtc: {...}`); exits non-zero on any mismatch.

Usage: gpu_rtc.py --petite PETITE --export DIR --case DIR --tokenizer TOKENIZER.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import petite

# The lerobot-policy tier's readers and comparison (this script's folder is on sys.path when it
# runs; that module imports lerobot only inside the functions not used here).
from python_policy import observations, rtc_goldens, start_serve, worst


def goldens(case: Path) -> list:
    """(observation, settings, tensors) of each RTC golden; the observations are the loop's."""
    return rtc_goldens(case, observations(case / "loop.safetensors"))


def check(face, gs, what: str) -> float:
    w = 0.0
    for j, (obs, m, t) in enumerate(gs):
        kw = dict(
            prev_chunk_left_over=t["prev_chunk_left_over"],
            inference_delay=m["inference_delay"],
            execution_horizon=m["execution_horizon"],
            max_guidance_weight=m["max_guidance_weight"],
            prefix_attention_schedule=m["schedule"],
        )
        w = max(w, worst(face.predict_action_chunk(obs, noise=t["noise"], **kw), t["model"][None], f"{what} {j} model"))
        w = max(w, worst(face.act(obs, noise=t["noise"], **kw), t["action"], f"{what} {j} action"))
    return w


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--petite", required=True)
    ap.add_argument("--export", required=True)
    ap.add_argument("--case", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--device", default="cuda", help="cuda (the gpu tier); cpu to try it anywhere")
    a = ap.parse_args()
    gs = goldens(Path(a.case))
    out = {"case": Path(a.case).name, "goldens": len(gs)}
    out["device"] = a.device
    with petite.Policy(a.export, device=a.device, tokenizer=a.tokenizer) as policy:
        out["policy"] = check(policy, gs, f"petite.Policy({a.device})")
    print(f"gpu-rtc: petite.Policy on {a.device}: {len(gs)} RTC goldens within {out['policy']:.2e}", flush=True)
    server, addr = start_serve(a.petite, a.export, "--device", a.device, "--tokenizer", a.tokenizer)
    try:
        with petite.Client(addr, timeout=120.0) as client:
            out["serve"] = check(client, gs, f"petite.Client(serve, {a.device})")
    finally:
        server.terminate()
        rc = server.wait(timeout=60)
    if rc != 0:
        raise AssertionError(f"petite serve exited {rc} after SIGTERM")
    print(f"gpu-rtc: petite.Client against petite serve --device {a.device}: {len(gs)} RTC goldens within "
          f"{out['serve']:.2e}", flush=True)
    print("gpu-rtc: " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
