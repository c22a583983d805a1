#!/usr/bin/env python3
"""lerobot's own real-time-chunking rollout driving the petite plugin (the lerobot-policy tier).

For each case folder that `make_policy_folders.py` wrote (and `petite export` exported to
`<case>/reference`), lerobot 0.6.1's rollout runs the plugin as `lerobot-rollout
--inference.type=rtc --strategy.type=base` would: `RolloutConfig` (policy type `petite` read from
the export's `config.json`, a scripted robot, `RTCInferenceConfig`), `build_rollout_context`
(lerobot loads the policy, checks `supports_rtc_inference`, sets `rtc_config`, builds the export's
pre/post-processors and its `RTCInferenceEngine`), then `BaseStrategy` runs its control loop at
FPS for SECONDS. The robot (`ScriptedRobot`, lerobot's `Robot` interface) answers each tick with
the next observation of the case's loop (cameras HWC uint8, joints `.pos`) and records, with
timestamps, every observation it gave and every action it was sent.

The policy's `predict_action_chunk` is wrapped to give each call seeded noise (so it can be
replayed), to record what lerobot's engine passed (`inference_delay`, `prev_chunk_left_over`),
and to stretch each call to TARGET_DELAY ticks minus 0.4 (the test models take milliseconds; a
real pi0.5 takes ticks, and only then does RTC have actions to blend): the engine measures that
latency and turns it into the delay of the next call. Checked:
  - every tick after the first chunk arrived sent the robot an action (no tick without one);
  - every chunk after the first got the previous chunk's leftover (its unexecuted model-space
    rows, as lerobot's ActionQueue keeps them) and an inference delay ≥ 1, the delay the engine
    measured;
  - RTC applied: each guided chunk differs from the plain chunk of the same batch and noise by
    far more than BOUND;
  - the chunks the engine got equal lerobot's PI05 on the same call (same preprocessed batch,
    noise, delay, leftover, RTCConfig) within BOUND × max(1, |a|), for the first REPLAYED calls;
  - every action sent is a row of a post-processed chunk, past the rows dropped for the delay.
Prints one line per case and a JSON summary (`lerobot-rtc-engine: {...}`); exits non-zero on any
failure.

Usage: rtc_engine.py --out DIR CASE [CASE ...]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.numpy import load_file

from lerobot.robots import Robot, RobotConfig

BOUND = 1e-4
FPS = 30
SECONDS = 5.0
# Calls replayed through lerobot's PI05 (each a few ms on CPU after the load).
REPLAYED = 12


def target_delay(chunk: int) -> int:
    """The inference delay, in ticks, each call is stretched to: a third of the chunk, ≥ 1."""
    return max(1, chunk // 3)


# --- the scripted robot --------------------------------------------------------------------------


@RobotConfig.register_subclass("petite_scripted")
@dataclass
class ScriptedRobotConfig(RobotConfig):
    """A robot that replays a case's loop (`loop.safetensors`)."""

    loop: str = ""
    action_dim: int = 0


class ScriptedRobot(Robot):
    """lerobot's `Robot` interface over recorded observations: tick i answers observation
    i mod len(loop); every observation given and action sent is recorded with its time. lerobot
    finds it by name (`make_device_from_device_class`: ScriptedRobotConfig → ScriptedRobot)."""

    config_class = ScriptedRobotConfig
    name = "petite_scripted"

    def __init__(self, config: ScriptedRobotConfig):
        super().__init__(config)
        t = load_file(config.loop)
        with safe_open(config.loop, "np") as f:
            n = len(json.loads(f.metadata()["tasks"]))
        self.frames = []
        for i in range(n):
            p = f"{i:02d}/"
            frame = {}
            for k, v in t.items():
                if k.startswith(p + "observation.images."):
                    a = v[0] if v.ndim == 4 else v
                    if a.dtype != np.uint8:  # float CHW in [0, 1] → a camera's HWC uint8
                        a = np.round(np.clip(a.transpose(1, 2, 0), 0, 1) * 255).astype(np.uint8)
                    frame[k[len(p + "observation.images."):]] = np.ascontiguousarray(a)
            for j, x in enumerate(t[p + "observation.state"].reshape(-1)):
                frame[f"joint_{j}.pos"] = float(x)
            self.frames.append(frame)
        first = self.frames[0]
        if any(f.keys() != first.keys() for f in self.frames):
            raise AssertionError(f"{config.loop}: the loop's observations have different cameras")
        self.cameras_shape = {k: v.shape for k, v in first.items() if isinstance(v, np.ndarray)}
        self.joints = [k for k in first if k.endswith(".pos")]
        self.action_keys = [f"joint_{j}.pos" for j in range(config.action_dim)]
        self.connected = False
        self.ticks: list[float] = []
        self.sent: list[tuple[float, int, np.ndarray]] = []

    @property
    def observation_features(self) -> dict:
        return {**{k: float for k in self.joints}, **self.cameras_shape}

    @property
    def action_features(self) -> dict:
        return dict.fromkeys(self.action_keys, float)

    @property
    def is_connected(self) -> bool:
        return self.connected

    def connect(self, calibrate: bool = True) -> None:
        self.connected = True

    @property
    def is_calibrated(self) -> bool:
        return True

    def calibrate(self) -> None:
        pass

    def configure(self) -> None:
        pass

    def get_observation(self) -> dict:
        self.ticks.append(time.perf_counter())
        return dict(self.frames[(len(self.ticks) - 1) % len(self.frames)])

    def send_action(self, action: dict) -> dict:
        self.sent.append((time.perf_counter(), len(self.ticks) - 1, np.array([action[k] for k in self.action_keys], np.float32)))
        return action

    def disconnect(self) -> None:
        self.connected = False


# --- checks ----------------------------------------------------------------------------------


def worst(got: np.ndarray, want: np.ndarray, what: str) -> float:
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {got.shape}, lerobot {want.shape}")
    if not (np.isfinite(got).all() and np.isfinite(want).all()):
        raise AssertionError(f"{what}: not finite")
    rel = np.abs(got.astype(np.float64) - want) / np.maximum(1.0, np.abs(want.astype(np.float64)))
    w = float(rel.max())
    if w > BOUND:
        raise AssertionError(f"{what}: off by {w:.3e} × max(1, |a|) > {BOUND:g}")
    return w


def leftover_offset(prev: np.ndarray, before: np.ndarray, absolute: np.ndarray) -> int:
    """Where the leftover starts in the previous chunk's model output: lerobot's ActionQueue keeps
    the chunk's rows past those executed, padded with zeros (or cut) to the execution horizon.
    Columns of relative actions are re-anchored to the current state by lerobot's engine
    (`reanchor_relative_rtc_prefix`: un-normalized, made relative, normalized again), so only
    the `absolute` ones are compared, within float round-off when some are relative. Fails
    unless `prev` is such a tail of `before`."""
    h, chunk = prev.shape[0], before.shape[0]
    tol = 0.0 if absolute.all() else 1e-5
    for s in range(1, chunk):
        rows = min(h, chunk - s)
        a, b = prev[:rows, absolute], before[s : s + rows, absolute]
        if np.all(np.abs(a - b) <= tol * np.maximum(1.0, np.abs(b))) and (tol or not prev[rows:].any()):
            return s
    raise AssertionError(f"a leftover that is not the unexecuted tail of the previous chunk: {prev} of {before}")


def run_case(out: Path, case: str) -> dict:
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.configs import RTCAttentionSchedule
    from lerobot.policies.rtc.configuration_rtc import RTCConfig
    from lerobot.rollout import (
        BaseStrategy,
        BaseStrategyConfig,
        RolloutConfig,
        RTCInferenceConfig,
        build_rollout_context,
    )
    from threading import Event

    d = out / case
    export = d / "reference"
    cfg = PreTrainedConfig.from_pretrained(export)
    cfg.pretrained_path = export
    chunk = cfg.chunk_size
    action_dim = cfg.output_features["action"].shape[0]
    delay_target = target_delay(chunk)
    threshold = chunk - delay_target - 1
    horizon = threshold
    rtc = RTCConfig(enabled=True, execution_horizon=horizon, max_guidance_weight=10.0,
                    prefix_attention_schedule=RTCAttentionSchedule.LINEAR)
    with safe_open(str(d / "loop.safetensors"), "np") as f:
        task = json.loads(f.metadata()["tasks"])[0]
    rollout = RolloutConfig(
        robot=ScriptedRobotConfig(loop=str(d / "loop.safetensors"), action_dim=action_dim,
                                  calibration_dir=out / "calibration"),
        policy=cfg,
        strategy=BaseStrategyConfig(),
        inference=RTCInferenceConfig(rtc=rtc, queue_threshold=threshold),
        fps=FPS,
        duration=SECONDS,
        device="cpu",
        task=task,
        play_sounds=False,
        return_to_initial_position=False,
    )
    shutdown = Event()
    ctx = build_rollout_context(rollout, shutdown)
    policy = ctx.policy.policy
    robot = ctx.hardware.robot_wrapper.inner
    if type(policy).__name__ != "PetitePolicy" or not isinstance(robot, ScriptedRobot):
        raise AssertionError(f"lerobot built a {type(policy).__name__} and a {type(robot).__name__}")
    max_action_dim = policy.petite.info["max_action_dim"] if "max_action_dim" in policy.petite.info else None

    # The policy as lerobot's engine calls it, recorded and stretched to the target delay.
    calls = []
    plain = policy.predict_action_chunk
    tick = 1.0 / FPS
    rng = np.random.Generator(np.random.PCG64(7))

    def traced(batch, inference_delay=None, prev_chunk_left_over=None, **kw):
        t0 = time.perf_counter()
        width = max_action_dim or batch["observation.state"].shape[-1]
        noise = rng.standard_normal((1, chunk, width), dtype=np.float32)
        got = plain(batch, noise=torch.from_numpy(noise), inference_delay=inference_delay,
                    prev_chunk_left_over=prev_chunk_left_over, **kw)
        compute = time.perf_counter() - t0
        time.sleep(max(0.0, (delay_target - 0.4) * tick - compute))
        calls.append(dict(
            t0=t0, t1=time.perf_counter(), compute=compute, delay=inference_delay,
            prev=None if prev_chunk_left_over is None else prev_chunk_left_over.detach().cpu().numpy().copy(),
            noise=noise, batch={k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()},
            model=got.detach().cpu().numpy()[0].copy(),
        ))
        return got

    policy.predict_action_chunk = traced
    strategy = BaseStrategy(rollout.strategy)
    strategy.setup(ctx)
    engine = ctx.policy.inference
    queue = engine.action_queue
    merges = []
    merge = queue.merge

    def traced_merge(original, processed, real_delay, idx_before=None):
        merges.append(dict(delay=real_delay, consumed=queue.get_action_index() - idx_before,
                           processed=processed.detach().cpu().numpy().copy()))
        return merge(original, processed, real_delay, idx_before)

    queue.merge = traced_merge
    robot.ticks.clear()
    robot.sent.clear()
    start = time.perf_counter()
    try:
        strategy.run(ctx)
    finally:
        strategy.teardown(ctx)
    wall = time.perf_counter() - start
    if engine.failed:
        raise AssertionError("lerobot's RTC thread failed (see its log above)")

    # Every tick after the first action served one.
    ticks = len(robot.ticks)
    served = Counter(t for _, t, _ in robot.sent)
    if not robot.sent:
        raise AssertionError("no action reached the robot")
    first = robot.sent[0][1]
    missing = [t for t in range(first, ticks) if served[t] == 0]
    doubled = [t for t, n in served.items() if n > 1]
    if ticks < 0.9 * FPS * SECONDS:
        raise AssertionError(f"{ticks} ticks in {wall:.1f} s at {FPS} Hz")
    if missing or doubled:
        raise AssertionError(f"ticks without an action after the first chunk: {missing[:10]} ({len(missing)}); "
                             f"ticks with two: {doubled[:10]}")

    # Leftovers and delays as lerobot's engine passed them.
    if len(calls) < 5 or calls[0]["prev"] is not None:
        raise AssertionError(f"{len(calls)} chunks, the first with a leftover: {calls[0]['prev'] is not None}")
    relative = engine._relative_step
    absolute = np.ones(action_dim, bool)
    if relative is not None:
        absolute = ~np.array(relative._build_mask(action_dim) + [False] * action_dim, bool)[:action_dim]
    if not absolute.any():
        raise AssertionError("every action column relative: no column of the leftover to compare")
    offsets = []
    for k in range(1, len(calls)):
        c = calls[k]
        if c["prev"] is None or not c["delay"] or c["delay"] < 1:
            raise AssertionError(f"chunk {k}: leftover {c['prev'] is not None}, inference_delay {c['delay']}")
        if c["prev"].shape != (horizon, action_dim):
            raise AssertionError(f"chunk {k}: leftover {c['prev'].shape}, expected ({horizon}, {action_dim})")
        offsets.append(leftover_offset(c["prev"], calls[k - 1]["model"], absolute))

    # RTC applied: each guided chunk moved off the plain one of the same batch and noise.
    moved = []
    for c in calls[1:]:
        p = plain(c["batch"], noise=torch.from_numpy(c["noise"])).numpy()[0]
        moved.append(float(np.abs(c["model"] - p).max()))
    if min(moved) <= 100 * BOUND:
        raise AssertionError(f"a guided chunk equal to the plain one (moved {min(moved):.2e})")

    # lerobot's PI05 on the same calls.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import make_pi05_goldens as g
    import make_policy_folders as folders
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy

    spec = {c.name: c for c in folders.CASES}[case]
    with g.small_model(folders.sizes(spec)), contextlib.redirect_stdout(io.StringIO()):
        pi05 = PI05Policy.from_pretrained(str(d / "policy"))
    pi05.eval()
    pi05.config.rtc_config = rtc
    pi05.init_rtc_processor()
    w_pi05 = 0.0
    with torch.no_grad():
        for k, c in enumerate(calls[:REPLAYED]):
            prev = None if c["prev"] is None else torch.from_numpy(c["prev"])
            want = pi05.predict_action_chunk(c["batch"], noise=torch.from_numpy(c["noise"]),
                                             inference_delay=c["delay"], prev_chunk_left_over=prev)
            w_pi05 = max(w_pi05, worst(c["model"], want.numpy()[0], f"engine chunk {k} vs lerobot's PI05"))

    # Every action sent is a row of a merged, post-processed chunk past its delay.
    rows = {r.tobytes() for m in merges for r in m["processed"][max(0, m["delay"]):]}
    stray = sum(1 for _, _, a in robot.sent if a.tobytes() not in rows)
    if stray:
        raise AssertionError(f"{stray} actions sent that are no post-processed chunk's")

    delays = Counter(int(c["delay"]) for c in calls[1:])
    consumed = Counter(m["consumed"] for m in merges[1:])
    latency_ms = [(c["t1"] - c["t0"]) * 1e3 for c in calls]
    compute_ms = [c["compute"] * 1e3 for c in calls]
    r = {
        "case": case,
        "fps": FPS,
        "seconds": round(wall, 2),
        "ticks": ticks,
        "first_action_tick": first,
        "actions_sent": len(robot.sent),
        "ticks_without_action_after_first": len(missing),
        "chunks": len(calls),
        "chunk": chunk,
        "execution_horizon": horizon,
        "queue_threshold": threshold,
        "inference_delays": dict(sorted(delays.items())),
        "consumed_during_inference": dict(sorted(consumed.items())),
        "latency_ms_median": statistics.median(latency_ms),
        "latency_ms_max": max(latency_ms),
        "compute_ms_median": statistics.median(compute_ms),
        "leftover_offsets": dict(sorted(Counter(offsets).items())),
        "min_moved_by_rtc": min(moved),
        "worst_vs_pi05": w_pi05,
    }
    print(
        f"lerobot-rtc-engine: {case}: lerobot's RTCInferenceEngine (BaseStrategy, build_rollout_context) over the "
        f"petite plugin, scripted robot at {FPS} Hz for {wall:.1f} s: {ticks} ticks, {len(robot.sent)} actions sent "
        f"(first at tick {first}), 0 ticks without an action after it; {len(calls)} chunks of {chunk} "
        f"(horizon {horizon}, threshold {threshold}), each after the first with the previous chunk's leftover "
        f"(rows from {sorted(set(offsets))}{'' if relative is None else ', relative columns re-anchored by lerobot'}) and the delay lerobot measured {dict(sorted(delays.items()))} "
        f"(actions executed meanwhile {dict(sorted(consumed.items()))}); latency median {statistics.median(latency_ms):.0f} ms "
        f"(compute {statistics.median(compute_ms):.1f} ms, stretched to {delay_target - 0.4:.1f} ticks); "
        f"RTC moved every guided chunk ≥ {min(moved):.2e}; {min(REPLAYED, len(calls))} chunks within {w_pi05:.2e} of "
        f"lerobot's PI05 on the same call",
        flush=True,
    )
    policy.petite.close()
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("cases", nargs="+")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    # lerobot's ActionQueue warns at every merge whose measured delay (latency rounded up to
    # ticks) differs from the actions executed meanwhile; both are reported instead.
    logging.getLogger("lerobot.policies.rtc.action_queue").setLevel(logging.ERROR)
    from lerobot.utils.import_utils import register_third_party_plugins

    register_third_party_plugins()
    results = [run_case(args.out, c) for c in args.cases]
    print("lerobot-rtc-engine: " + json.dumps({"cases": results}), flush=True)


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"lerobot-rtc-engine: FAILED: {e}", file=sys.stderr)
        sys.exit(1)
