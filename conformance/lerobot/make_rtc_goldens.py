#!/usr/bin/env python3
"""lerobot 0.6.1's real-time chunking (RTC) on the policy folders `make_policy_folders.py` wrote.

For each case named, this loads the saved folder as a user's run would (`PI05Policy.
from_pretrained`, `make_pre_post_processors(config, pretrained_path=folder)`), turns RTC on
(`config.rtc_config = RTCConfig(...)`, `init_rtc_processor()`), and runs lerobot's
preprocessor → `predict_action_chunk(batch, noise=, inference_delay=, prev_chunk_left_over=,
execution_horizon=)` → postprocessor on observations of the case's loop (`loop.safetensors`),
for every prefix-attention schedule (ZEROS, ONES, LINEAR, EXP) × inference delays 0, 3 and one
past the execution horizon. The leftover is the previous loop observation's model chunk less
its first row: shorter than the chunk, longer than the horizon (so the LINEAR/EXP ramps run).

Writes `<case>/rtc/NN/observation.safetensors` (the observation, `noise` and
`rtc.prev_chunk_left_over`, metadata `task`: what `petite act` reads) and `expected.safetensors`
(lerobot's `action`, `tokens`, `token_mask`), and `<case>/rtc.safetensors`: per golden `NN/` the loop index's observation is reused (the
consumer reads it from loop.safetensors), `NN/noise`, `NN/prev_chunk_left_over` (model space,
`[rows, action_dim]`), lerobot's `NN/model` (`[chunk, action_dim]`) and `NN/action`
(postprocessed); metadata `rtc` is a JSON list of {obs, schedule, inference_delay,
execution_horizon, max_guidance_weight, differs} where `differs` says whether the schedule
weights any row (ZEROS with delay 0 weights none: its chunk must equal the plain one). Every
golden whose weights are not all zero is checked here to differ from the plain chunk by far more
than the conformance bound (a no-op RTC must fail the comparison).

Usage: make_rtc_goldens.py --out DIR CASE [CASE ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_pi05_goldens as g  # noqa: E402
import make_policy_folders as folders  # noqa: E402

from lerobot.configs import RTCAttentionSchedule  # noqa: E402
from lerobot.policies.factory import make_pre_post_processors  # noqa: E402
from lerobot.policies.pi05.modeling_pi05 import PI05Policy  # noqa: E402
from lerobot.policies.rtc.configuration_rtc import RTCConfig  # noqa: E402

SCHEDULES = ["ZEROS", "ONES", "LINEAR", "EXP"]
MAX_GUIDANCE = 10.0
# The conformance bound is 1e-4; a guided chunk must move by far more than it.
MIN_DIFFERENCE = 1e-2


def loop_observation(t: dict, i: int) -> dict:
    p = f"{i:02d}/"
    return {k[len(p):]: v for k, v in t.items() if k.startswith(p) and k[len(p):].startswith("observation.")}


def to_torch(obs: dict, task: str) -> dict:
    out = {}
    for k, v in obs.items():
        a = np.asarray(v)
        if k.startswith("observation.images."):
            if a.ndim == 4:
                a = a[0]
            if a.dtype == np.uint8:
                a = a.astype(np.float32).transpose(2, 0, 1) / 255.0
            out[k] = torch.from_numpy(np.ascontiguousarray(a, np.float32))[None]
        else:
            out[k] = torch.from_numpy(np.ascontiguousarray(a.reshape(-1), np.float32))[None]
    out["task"] = [task]
    return out


def make(case_dir: Path, case) -> int:
    folder = case_dir / "policy"
    with g.small_model(folders.sizes(case)):
        policy = PI05Policy.from_pretrained(str(folder))
    policy.eval()
    pre, post = make_pre_post_processors(policy.config, pretrained_path=str(folder))
    path = case_dir / "loop.safetensors"
    loop = load_file(str(path))
    with safe_open(str(path), "np") as f:
        tasks = json.loads(f.metadata()["tasks"])
    chunk = case.chunk
    rows = chunk - 1
    horizon = rows - 1  # the leftover is longer than the horizon
    delays = [0, min(3, horizon), horizon + 1]
    tensors, meta = {}, []
    rng = np.random.Generator(np.random.PCG64(case.seed + 2))
    for schedule in SCHEDULES:
        policy.config.rtc_config = RTCConfig(
            enabled=True,
            prefix_attention_schedule=RTCAttentionSchedule[schedule],
            max_guidance_weight=MAX_GUIDANCE,
            execution_horizon=horizon,
        )
        policy.init_rtc_processor()
        for delay in delays:
            j = len(meta)
            i = 1 + j % (len(tasks) - 1)
            obs = loop_observation(loop, i)
            prev = loop[f"{i - 1:02d}/model"][1:].astype(np.float32)
            assert prev.shape == (rows, case.action_dim), prev.shape
            noise = rng.standard_normal((chunk, case.max_action_dim), dtype=np.float32)
            with torch.no_grad():
                batch = pre(to_torch(obs, tasks[i]))
                model = policy.predict_action_chunk(
                    batch,
                    noise=torch.from_numpy(noise)[None].clone(),
                    inference_delay=delay,
                    prev_chunk_left_over=torch.from_numpy(prev)[None].clone(),
                    execution_horizon=horizon,
                )
                actions = post(model.clone())
                # The plain chunk for the same observation and noise.
                policy.config.rtc_config.enabled = False
                plain = policy.predict_action_chunk(batch, noise=torch.from_numpy(noise)[None].clone())
                policy.config.rtc_config.enabled = True
            m = model[0].numpy().astype(np.float32)
            a = actions[0].numpy().astype(np.float32)
            assert m.shape == a.shape == (chunk, case.action_dim) and np.isfinite(a).all() and np.isfinite(m).all()
            weights = policy.rtc_processor.get_prefix_weights(delay, horizon, chunk)
            differs = bool((weights != 0).any())
            moved = float(np.abs(m - plain[0].numpy()).max())
            if differs and moved <= MIN_DIFFERENCE:
                raise SystemExit(f"{case.name} {schedule} delay {delay}: RTC moved the chunk by only {moved:.2e}")
            if not differs and moved != 0.0:
                raise SystemExit(f"{case.name} {schedule} delay {delay}: no row weighted, yet the chunk moved {moved:.2e}")
            # The golden as `petite act` reads it: the observation with its noise and leftover,
            # lerobot's actions, tokens and mask.
            d = case_dir / "rtc" / f"{j:02d}"
            d.mkdir(parents=True, exist_ok=True)
            save_file({**{k: np.ascontiguousarray(v) for k, v in obs.items()}, "noise": noise,
                       "rtc.prev_chunk_left_over": prev},
                      str(d / "observation.safetensors"), metadata={"task": tasks[i]})
            save_file({"action": a,
                       "tokens": batch["observation.language.tokens"][0].numpy().astype(np.int64),
                       "token_mask": batch["observation.language.attention_mask"][0].numpy().astype(np.uint8)},
                      str(d / "expected.safetensors"))
            p = f"{j:02d}/"
            tensors[p + "noise"] = noise
            tensors[p + "prev_chunk_left_over"] = prev
            tensors[p + "model"] = m
            tensors[p + "action"] = a
            tensors[p + "plain_model"] = plain[0].numpy().astype(np.float32)
            meta.append({"obs": i, "schedule": schedule, "inference_delay": delay, "execution_horizon": horizon,
                         "max_guidance_weight": MAX_GUIDANCE, "differs": differs, "moved": moved})
    save_file(tensors, str(case_dir / "rtc.safetensors"), metadata={"rtc": json.dumps(meta)})
    print(f"{case.name}: {len(meta)} RTC goldens (schedules {SCHEDULES}, delays {delays}, horizon {horizon}, "
          f"leftover {rows} of {chunk} rows); guided chunks moved {min(x['moved'] for x in meta if x['differs']):.3f}"
          f"..{max(x['moved'] for x in meta):.3f} from the plain ones", flush=True)
    return len(meta)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("cases", nargs="+")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    by_name = {c.name: c for c in folders.CASES}
    for name in args.cases:
        make(args.out / name, by_name[name])


if __name__ == "__main__":
    main()
