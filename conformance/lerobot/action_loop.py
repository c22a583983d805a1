#!/usr/bin/env python3
"""`petite.ActionLoop` (robot-side real-time chunking) over `petite serve` on loopback (the
lerobot-policy tier).

For each case's reference export (`<case>/reference`), ONE `petite serve` and ROBOTS robots, each a
thread with its own `petite.Client` and `petite.ActionLoop`, ticking at FPS for SECONDS: every tick
the robot publishes its next observation (robot r takes loop observations r, r + ROBOTS, …: no two
robots share one) and takes one action. Each request is stretched to `target_delay` + 0.5 ticks (a
proxy around the client sleeps; the test models answer in milliseconds, a real pi0.5 in ticks,
and only then does RTC have executed actions to account for). Checked per robot:
  - no tick without an action after the first chunk arrived, ≥ 90 % of FPS × SECONDS ticks;
  - each chunk after the first sent the previous chunk's unexecuted model rows as the leftover
    (exactly: the tail of its `model` past the rows skipped and executed) and the delay measured
    (≥ 1 tick from the third chunk on);
  - each reply is the one for the robot's own request: equal bit for bit to an in-process
    `petite.Policy.act_chunk` on the same observation, seed and RTC keywords (a mixed-up reply
    from another robot's observation fails);
  - RTC applied: each guided chunk differs from the plain chunk (same observation and seed) by far
    more than the conformance bound;
  - every action served is its chunk's `actions` row of the same index as the model row kept.
Prints one line per case and robot, and a JSON summary (`petite-action-loop: {...}`); exits
non-zero on any failure.

Usage: action_loop.py --out DIR --petite PETITE CASE [CASE ...]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

import petite

sys.path.insert(0, str(Path(__file__).resolve().parent))
from python_policy import BOUND, observations, start_serve  # noqa: E402

FPS = 30
SECONDS = 5.0
ROBOTS = 2


def target_delay(chunk: int) -> int:
    """The inference delay, in ticks, each request is stretched to: a third of the chunk, ≥ 1."""
    return max(1, chunk // 3)


class Slow:
    """A `petite.Client` whose chunks take `seconds` at least (the policy's compute included)."""

    def __init__(self, client: petite.Client, seconds: float):
        self.client, self.seconds = client, seconds

    def act_chunk(self, obs, **kw):
        t0 = time.perf_counter()
        c = self.client.act_chunk(obs, **kw)
        time.sleep(max(0.0, self.seconds - (time.perf_counter() - t0)))
        return c


def robot(addr: str, r: int, loop_obs: list, chunk: int, result: dict) -> None:
    try:
        client = petite.Client(addr, timeout=60.0)
        d = target_delay(chunk)
        threshold = chunk - d - 1
        source = Slow(client, (d + 0.5) / FPS)
        served = []
        with petite.ActionLoop(source, fps=FPS, queue_threshold=threshold, execution_horizon=threshold,
                               seed=1000 * (r + 1)) as loop:
            tick = 1.0 / FPS
            t_next = time.perf_counter()
            end = t_next + SECONDS
            i = 0
            while time.perf_counter() < end:
                loop.observe(loop_obs[(r + ROBOTS * i) % len(loop_obs)][0])
                a = loop.next_action()
                served.append(a)
                i += 1
                t_next += tick
                time.sleep(max(0.0, t_next - time.perf_counter()))
            stats = loop.stats()
            records = list(loop.chunks)
        result.update(served=served, stats=stats, records=records, threshold=threshold, target=d)
    except BaseException as e:  # noqa: BLE001 - reported by the main thread
        result["error"] = e


def check_robot(local: petite.Policy, r: int, res: dict, chunk: int) -> dict:
    if "error" in res:
        raise AssertionError(f"robot {r}: {res['error']!r}")
    served, stats, records = res["served"], res["stats"], res["records"]
    ticks = len(served)
    first = next((i for i, a in enumerate(served) if a is not None), None)
    if first is None:
        raise AssertionError(f"robot {r}: no action in {ticks} ticks")
    missing = [i for i in range(first, ticks) if served[i] is None]
    if ticks < 0.9 * FPS * SECONDS or missing or stats["empty_ticks_after_first_chunk"]:
        raise AssertionError(f"robot {r}: {ticks} ticks, without an action after the first chunk: {missing[:10]}")
    if len(records) < 5 or records[0].prev_chunk_left_over is not None:
        raise AssertionError(f"robot {r}: {len(records)} chunks")
    # Leftover and delay as sent; each reply equal to the in-process policy's for its own request.
    moved = []
    rows_served = {}
    for k, rec in enumerate(records):
        kw = {}
        if k:
            before = records[k - 1]
            skip = min(before.executed_meanwhile, chunk)
            executed = rec.requested_at_tick - before.requested_at_tick - before.executed_meanwhile
            # The rows of the previous chunk not executed when the request went out.
            want = np.asarray(before.chunk.model, np.float32).reshape(chunk, -1)[skip + executed:]
            prev = rec.prev_chunk_left_over
            if prev is None or not np.array_equal(prev, want):
                raise AssertionError(f"robot {r}, chunk {k}: the leftover is not the unexecuted tail of chunk {k - 1}")
            if rec.inference_delay != max(x.executed_meanwhile for x in records[max(0, k - 10):k]):
                raise AssertionError(f"robot {r}, chunk {k}: inference_delay {rec.inference_delay} is not the delay measured")
            if k >= 2 and rec.inference_delay < 1:
                raise AssertionError(f"robot {r}, chunk {k}: inference_delay 0 from requests that took {res['target'] + 0.5} ticks")
            kw = dict(prev_chunk_left_over=prev, inference_delay=rec.inference_delay, execution_horizon=res["threshold"])
        mine = local.act_chunk(rec.observation, seed=rec.seed, **kw)
        for what in ("actions", "model"):
            if not np.array_equal(getattr(rec.chunk, what), getattr(mine, what)):
                raise AssertionError(f"robot {r}, chunk {k}: {what} is not the answer to its own request")
        if k:
            plain = local.act_chunk(rec.observation, seed=rec.seed)
            moved.append(float(np.abs(np.asarray(rec.chunk.model) - np.asarray(plain.model)).max()))
        skip = min(rec.executed_meanwhile, chunk)
        for j, row in enumerate(np.asarray(rec.chunk.actions, np.float32)[skip:]):
            rows_served.setdefault(row.tobytes(), (k, skip + j))
    if min(moved) <= 100 * BOUND:
        raise AssertionError(f"robot {r}: a guided chunk equal to the plain one (moved {min(moved):.2e})")
    stray = sum(1 for a in served if a is not None and a.tobytes() not in rows_served)
    if stray:
        raise AssertionError(f"robot {r}: {stray} actions served that are no chunk's")
    executed = Counter(x.executed_meanwhile for x in records[1:])
    sent = Counter(x.inference_delay for x in records[1:])
    lat = [x.latency * 1e3 for x in records]
    return {
        "robot": r,
        "ticks": ticks,
        "served": stats["served"],
        "first_action_tick": first,
        "ticks_without_action_after_first": len(missing),
        "chunks": len(records),
        "queue_threshold": res["threshold"],
        "executed_meanwhile": dict(sorted(executed.items())),
        "inference_delay_sent": dict(sorted(sent.items())),
        "latency_ms_median": statistics.median(lat),
        "latency_ms_max": max(lat),
        "min_moved_by_rtc": min(moved),
    }


def run_case(out: Path, case: str, petite_bin: Path) -> dict:
    d = out / case
    loop_obs = observations(d / "loop.safetensors")
    local = petite.Policy(str(d / "reference"), device="cpu", seed=0)
    chunk = local.info["chunk"]
    server, addr = start_serve(petite_bin, d / "reference", "--seed", "0")
    try:
        results = [{} for _ in range(ROBOTS)]
        threads = [threading.Thread(target=robot, args=(addr, r, loop_obs, chunk, results[r])) for r in range(ROBOTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        server.send_signal(signal.SIGTERM)
        if server.wait(timeout=60) != 0:
            raise AssertionError("petite serve did not exit 0 after SIGTERM")
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    robots = [check_robot(local, r, results[r], chunk) for r in range(ROBOTS)]
    local.close()
    for x in robots:
        print(
            f"petite-action-loop: {case}: robot {x['robot']} of {ROBOTS} on one petite serve (loopback), "
            f"petite.ActionLoop at {FPS} Hz for {SECONDS:.0f} s: {x['ticks']} ticks, {x['served']} actions served "
            f"(first at tick {x['first_action_tick']}), 0 ticks without an action after it; {x['chunks']} chunks of "
            f"{chunk} (threshold and horizon {x['queue_threshold']}), each reply its own request's (bit for bit the "
            f"in-process Policy's), each after the first with the previous chunk's unexecuted model rows; delay "
            f"measured (ticks executed meanwhile) {x['executed_meanwhile']}, sent {x['inference_delay_sent']}; "
            f"latency median {x['latency_ms_median']:.0f} ms (stretched to {target_delay(chunk) + 0.5:.1f} ticks), "
            f"max {x['latency_ms_max']:.0f} ms; RTC moved every guided chunk ≥ {x['min_moved_by_rtc']:.2e}",
            flush=True,
        )
    return {"case": case, "chunk": chunk, "robots": robots}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--petite", required=True, type=Path, help="the petite binary (for petite serve)")
    ap.add_argument("cases", nargs="+")
    args = ap.parse_args()
    results = [run_case(args.out, c, args.petite) for c in args.cases]
    print("petite-action-loop: " + json.dumps({"cases": results}), flush=True)


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"petite-action-loop: FAILED: {e}", file=sys.stderr)
        sys.exit(1)
