#!/usr/bin/env python3
"""Seconds per action chunk of lerobot 0.6.1's real PI05 ``sample_actions`` on this machine's CPU.

The baseline petite's CPU reference is compared with: same weights, same machine, same run.

    bench_sample_actions.py --checkpoint model.safetensors [--config config.json] [--runs 3]
        [--warmup 1] [--threads N] [--dtype float32|bfloat16]
        [--inputs inputs.safetensors [--expected expected.safetensors]]

Without ``--config`` the model is the real pi0.5 (lerobot defaults: 3 cameras of 224², 200
tokens, chunk 50, action dim 32); with a petite config.json (e.g. a testdata/pi05 case) it is built
with those sizes the way make_pi05_goldens.py builds them. The checkpoint must be in lerobot 0.6.1
layout (``model.`` prefix, 813 tensors for the real model). Loading copies one tensor at a time into
a model built without weight initialisation, so peak memory is about the model's own size
(~16.5 GB for the real model in float32), not twice it.

``--inputs`` uses a petite inputs file instead of seeded inputs; ``--expected`` then also checks
the actions against ``actions`` (float32) or ``actions_bf16`` and prints the max |Δ| (a smoke test
that the checkpoint was loaded into the right parameters).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from transformers.initialization import no_init_weights

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_pi05_goldens as goldens  # noqa: E402  (same directory; shares the model construction)

REAL = goldens.Case(
    name="pi05",
    seed=0,
    vision=goldens.Vision(image_size=224, patch_size=14, hidden=1152, layers=27, heads=16, mlp=4304),
    language=goldens.Gemma(width=2048, depth=18, heads=8, kv_heads=1, head_dim=256, mlp=16384),
    expert=goldens.Gemma(width=1024, depth=18, heads=8, kv_heads=1, head_dim=256, mlp=4096),
    vocab=257152,
    cameras=3,
    tokens=200,
    real_tokens=48,
    chunk=50,
    action_dim=32,
)


def case_from_config(path: Path) -> goldens.Case:
    c = json.loads(path.read_text())
    v, lg, e = c["vision"], c["language"], c["expert"]
    return goldens.Case(
        name=path.parent.name,
        seed=0,
        vision=goldens.Vision(v["image_size"], v["patch_size"], v["hidden"], v["layers"], v["heads"], v["mlp"]),
        language=goldens.Gemma(lg["width"], lg["depth"], lg["heads"], lg["kv_heads"], lg["head_dim"], lg["mlp"]),
        expert=goldens.Gemma(e["width"], e["depth"], e["heads"], e["kv_heads"], e["head_dim"], e["mlp"]),
        vocab=lg["vocab"],
        cameras=c["cameras"],
        tokens=c["tokens"],
        real_tokens=max(1, c["tokens"] // 4),
        chunk=c["chunk"],
        action_dim=c["action_dim"],
        steps=c["steps"],
    )


def build(case: goldens.Case, dtype: str, small: bool):
    with no_init_weights():
        if small:
            return goldens.build_policy(case, dtype)
        # The real sizes are lerobot's defaults: build it untouched.
        size = case.vision.image_size
        config = goldens.PI05Config(
            dtype=dtype,
            device="cpu",
            input_features={
                f"observation.images.cam{i}": goldens.PolicyFeature(
                    type=goldens.FeatureType.VISUAL, shape=(3, size, size)
                )
                for i in range(case.cameras)
            },
            output_features={
                "action": goldens.PolicyFeature(type=goldens.FeatureType.ACTION, shape=(case.action_dim,))
            },
        )
        policy = goldens.PI05Policy(config)
        policy.eval()
        return policy


def load(policy, checkpoint: Path) -> None:
    """Copies every checkpoint tensor into the matching parameter (dtype converted by copy_)."""
    params = policy.state_dict()
    seen = set()
    with safe_open(str(checkpoint), framework="pt") as f:
        for name in f.keys():
            if name not in params:
                raise SystemExit(f"{checkpoint}: unexpected tensor {name}")
            t = f.get_tensor(name)
            if tuple(t.shape) != tuple(params[name].shape):
                raise SystemExit(f"{checkpoint}: {name} has shape {tuple(t.shape)}, model wants {tuple(params[name].shape)}")
            with torch.no_grad():
                params[name].copy_(t)
            seen.add(name)
            del t
    missing = sorted(set(params) - seen)
    if missing:
        raise SystemExit(f"{checkpoint}: {len(missing)} tensors missing, e.g. {missing[:3]}")


def read_inputs(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, type=Path)
    p.add_argument("--config", type=Path, help="petite config.json (default: the real pi0.5)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--inputs", type=Path, help="petite inputs.safetensors (default: seeded)")
    p.add_argument("--expected", type=Path, help="expected.safetensors to check the actions against")
    args = p.parse_args()
    if args.expected and not args.inputs:
        p.error("--expected needs --inputs")

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    case = case_from_config(args.config) if args.config else REAL

    t0 = time.perf_counter()
    policy = build(case, args.dtype, small=args.config is not None)
    t_build = time.perf_counter() - t0
    load(policy, args.checkpoint)
    t_load = time.perf_counter() - t0 - t_build
    inputs = read_inputs(args.inputs) if args.inputs else goldens.make_inputs(case)

    times = []
    actions = None
    for i in range(args.warmup + args.runs):
        s = time.perf_counter()
        actions, _ = goldens.run_sample_actions(policy, inputs, case.steps, record=False)
        if i >= args.warmup:
            times.append(time.perf_counter() - s)
    result = {
        "model": case.name,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "build_s": round(t_build, 2),
        "load_s": round(t_load, 2),
        "runs": args.runs,
        "s_per_chunk_min": round(min(times), 4),
        "s_per_chunk_median": round(float(np.median(times)), 4),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "max_abs_actions": float(actions.abs().max()),
    }
    if args.expected:
        with safe_open(str(args.expected), framework="pt") as f:
            want = f.get_tensor("actions" if args.dtype == "float32" else "actions_bf16")
        result["max_abs_diff_vs_expected"] = float((actions - want).abs().max())
    print(json.dumps(result))
    if args.expected and result["max_abs_diff_vs_expected"] > 1e-6:
        print("actions differ from the expected file", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
