#!/usr/bin/env python3
"""petite's Python package against lerobot's pipeline, in a loop (the lerobot-policy tier).

For each case folder that `make_policy_folders.py` wrote (and `petite export` exported to
`<case>/reference`), this opens ONE `petite.Policy` and calls it over the case's loop of
observations (`loop.safetensors`) with lerobot's noise:
  - `act(obs, noise=...)` must equal lerobot's preprocessor → predict_action_chunk →
    postprocessor within BOUND × max(1, |a|) per action (f32);
  - `predict_action_chunk(obs, noise=...)` ([1, chunk, action_dim], model space) lerobot's
    `predict_action_chunk` within the same bound;
  - `act_chunk` gives lerobot's prompt tokens and attention mask exactly;
  - a bad observation raises ValueError naming the key, and the policy still answers;
  - a second Python thread makes progress while a chunk runs (the GIL is released);
  - with a queue of one and four threads calling, `wait=False` raises petite.Busy, and every
    waiting call gets its own right answer;
  - lerobot's real-time chunking (make_rtc_goldens.py: every schedule, several delays, a
    leftover shorter than the chunk) through lerobot's keywords within the same bound, a guided
    chunk far from the plain one, bad RTC input refused by key;
  - the per-call overhead over `Policy::act` in Rust (the call's wall time minus the time
    `Policy::act` took inside it, `ActionChunk.seconds`) is measured: median and p90 in µs.
Then `petite.Client` against `petite serve` (the binary given with --petite) serving the same
export on loopback: every answer over the loop equal bit for bit to the in-process Policy's, a
bad observation a ValueError naming the key, four threads sharing one client each answered
right, the round trip's overhead over the server's own time measured, and after SIGTERM the
server exits 0 and the client raises ConnectionError.
Prints one line per case and a JSON summary line (`petite-python: {...}`); exits non-zero on
any mismatch.

Usage: python_policy.py --out DIR --petite PETITE CASE [CASE ...]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file
from safetensors import safe_open

import petite

BOUND = 1e-4
REPEATS = 3  # passes over the loop for the timing (the first is also the comparison)


def worst(got: np.ndarray, want: np.ndarray, what: str) -> float:
    got = np.asarray(got)
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {got.shape}, lerobot {want.shape}")
    if got.dtype != np.float32:
        raise AssertionError(f"{what}: dtype {got.dtype}, expected float32")
    if not (np.isfinite(got).all() and np.isfinite(want).all()):
        raise AssertionError(f"{what}: not finite")
    rel = np.abs(got.astype(np.float64) - want) / np.maximum(1.0, np.abs(want.astype(np.float64)))
    w = float(rel.max())
    if w > BOUND:
        i = np.unravel_index(int(rel.argmax()), rel.shape)
        raise AssertionError(f"{what}: petite {got[i]}, lerobot {want[i]}: off by {w:.3e} × max(1, |a|) > {BOUND:g}")
    return w


def observations(path: Path):
    t = load_file(str(path))
    with safe_open(str(path), "np") as f:
        tasks = json.loads(f.metadata()["tasks"])
    out = []
    for i, task in enumerate(tasks):
        p = f"{i:02d}/"
        obs = {k[len(p) :]: v for k, v in t.items() if k.startswith(p) and k[len(p) :].startswith("observation.")}
        obs["task"] = task
        want = {k: t[p + k] for k in ("noise", "action", "model", "tokens", "token_mask")}
        out.append((obs, want))
    return out


def rtc_goldens(d: Path, loop) -> list:
    """The case's real-time-chunking goldens (make_rtc_goldens.py): (observation, settings,
    tensors) each."""
    path = d / "rtc.safetensors"
    t = load_file(str(path))
    with safe_open(str(path), "np") as f:
        meta = json.loads(f.metadata()["rtc"])
    out = []
    for j, m in enumerate(meta):
        p = f"{j:02d}/"
        out.append((loop[m["obs"]][0], m, {k: t[p + k] for k in ("noise", "prev_chunk_left_over", "model", "action",
                                                                  "plain_model")}))
    return out


def check_rtc(face, goldens, what: str) -> tuple[float, int]:
    """Every RTC golden through `face` (a petite.Policy or petite.Client) with lerobot's
    keywords: the model chunk and the actions within BOUND of lerobot's; a guided golden moved
    far from the plain chunk, an unweighted one equal to it. Then bad RTC input is refused by
    key and the face still answers. Returns (worst error, goldens)."""
    from lerobot.configs import RTCAttentionSchedule

    worst_err = 0.0
    for j, (obs, m, t) in enumerate(goldens):
        kw = dict(prev_chunk_left_over=t["prev_chunk_left_over"], inference_delay=m["inference_delay"],
                  execution_horizon=m["execution_horizon"], max_guidance_weight=m["max_guidance_weight"],
                  # lerobot's enum on some calls, its name on others
                  prefix_attention_schedule=RTCAttentionSchedule[m["schedule"]] if j % 2 else m["schedule"])
        model = face.predict_action_chunk(obs, noise=t["noise"], **kw)
        worst_err = max(worst_err, worst(model, t["model"][None], f"{what} RTC golden {j} model"))
        worst_err = max(worst_err, worst(face.act(obs, noise=t["noise"], **kw), t["action"], f"{what} RTC golden {j}"))
        moved = float(np.abs(model[0] - t["plain_model"]).max())
        if m["differs"] and moved <= 100 * BOUND:
            raise AssertionError(f"{what} RTC golden {j}: the guided chunk is the plain one (moved {moved:.2e})")
    obs, m, t = goldens[0]
    prev = t["prev_chunk_left_over"]
    bad = [
        (dict(prev_chunk_left_over=prev, inference_delay=-1), "rtc.inference_delay"),
        (dict(prev_chunk_left_over=prev), "rtc.inference_delay"),
        (dict(prev_chunk_left_over=np.zeros((prev.shape[0], prev.shape[1] + 1), np.float32), inference_delay=1),
         "rtc.prev_chunk_left_over"),
        (dict(prev_chunk_left_over=np.full_like(prev, np.nan), inference_delay=1), "rtc.prev_chunk_left_over"),
        (dict(prev_chunk_left_over=prev, inference_delay=1, prefix_attention_schedule="COSINE"),
         "rtc.prefix_attention_schedule"),
    ]
    for kw, key in bad:
        try:
            face.act(obs, noise=t["noise"], **kw)
        except ValueError as e:
            if f"`{key}`" not in str(e):
                raise AssertionError(f"{what}: the error for a bad `{key}` does not name it: {e}")
        else:
            raise AssertionError(f"{what}: a bad `{key}` was accepted: {sorted(kw)}")
    try:
        face.act(obs, noise=t["noise"], prev_chunk_left_over=prev, inference_delay=1, execution_horizont=3)
    except TypeError as e:
        assert "execution_horizont" in str(e), e
    else:
        raise AssertionError(f"{what}: a misspelt RTC keyword was accepted")
    # Still usable, and no leftover is a plain chunk whatever else is given (as lerobot).
    worst(face.predict_action_chunk(obs, noise=t["noise"], prev_chunk_left_over=None, inference_delay=3),
          t["plain_model"][None], f"{what}: after the refusals")
    return worst_err, len(goldens)


def gil_released(policy: petite.Policy, obs: dict, noise: np.ndarray) -> tuple[float, float]:
    """While a worker thread's call is inside Rust (its own chunk and, queued behind three other
    threads' calls, theirs), this thread spins taking timestamps. Were the GIL held there, this
    thread would stand still for the whole Rust part of the call: its longest pause inside the
    call would be at least the call's Rust time. Returns (that longest pause, the Rust seconds)
    for the first of up to 20 tries where the pause is under half the Rust time (on a loaded
    machine a try can lose the CPU), else for the best try."""
    best = None
    for _ in range(20):
        box = {}

        def work():
            t0 = time.perf_counter()
            c = policy.act_chunk(obs, noise=noise)
            box["span"] = (t0, time.perf_counter(), c.seconds)

        others = [threading.Thread(target=policy.act, args=(obs,), kwargs={"noise": noise}) for _ in range(3)]
        th = threading.Thread(target=work)
        for t in others:
            t.start()
        th.start()
        stamps = []
        while th.is_alive():
            stamps.append(time.perf_counter())
        th.join()
        for t in others:
            t.join()
        t0, t1, secs = box["span"]
        inside = [s for s in stamps if t0 <= s <= t1]
        edges = [t0] + inside + [t1]
        gap = max(b - a for a, b in zip(edges, edges[1:]))
        if best is None or gap / secs < best[0] / best[1]:
            best = (gap, secs)
        if gap < 0.5 * secs:
            break
    return best


def refusals(policy: petite.Policy, obs: dict, noise: np.ndarray, want: np.ndarray) -> int:
    """Bad observations raise ValueError naming the key; the policy answers afterwards."""
    state_key = "observation.state"
    cam = next(k for k in obs if k.startswith("observation.images."))
    bad = [
        ({**obs, state_key: np.full_like(obs[state_key], np.nan)}, state_key),
        ({k: v for k, v in obs.items() if k != state_key}, state_key),
        ({**obs, state_key: np.zeros(policy.info["state_dim"] + 1, np.float32)}, state_key),
        ({**obs, cam: np.zeros((2, 3, 8, 8), np.float32)}, cam),
        ({**obs, cam: np.zeros((8, 8, 3), np.int32)}, cam),
        ({**obs, "observation.images.nope": np.zeros((8, 8, 3), np.uint8)}, "observation.images.nope"),
        ({**obs, "task": "  "}, "task"),
        ({**obs, "task": 3}, "task"),
    ]
    for o, key in bad:
        try:
            policy.act(o, noise=noise)
        except ValueError as e:
            if f"`{key}`" not in str(e):
                raise AssertionError(f"the error for a bad `{key}` does not name it: {e}")
        else:
            raise AssertionError(f"a bad `{key}` was accepted")
    try:
        policy.act(obs, noise=noise[:, :-1])
    except ValueError as e:
        assert "`noise`" in str(e), e
    else:
        raise AssertionError("noise of the wrong width was accepted")
    worst(policy.act(obs, noise=noise), want, "after the refusals")
    return len(bad) + 1


def busy(export: Path, obs: dict, noise: np.ndarray, want: np.ndarray) -> int:
    """With a queue of one and four threads calling, `wait=False` raises petite.Busy; every
    waiting call still gets its own right answer. Returns the calls the threads made."""
    policy = petite.Policy(str(export), queue=1)
    stop = threading.Event()
    answers = []

    def caller():
        while not stop.is_set():
            answers.append(policy.act(obs, noise=noise))

    threads = [threading.Thread(target=caller) for _ in range(4)]
    for t in threads:
        t.start()
    refused = False
    try:
        for _ in range(2000):
            try:
                policy.act(obs, noise=noise, wait=False)
            except petite.Busy as e:
                assert "busy" in str(e), e
                refused = True
                break
            time.sleep(0.0005)
    finally:
        stop.set()
        for t in threads:
            t.join()
    if not refused:
        raise AssertionError("wait=False never raised petite.Busy with a queue of one and four callers")
    for a in answers:
        worst(a, want, "a queued call")
    policy.close()
    return len(answers)


def run_case(out: Path, case: str) -> dict:
    d = out / case
    loop = observations(d / "loop.safetensors")
    policy = petite.Policy(str(d / "reference"), device="cpu", seed=0)
    info = policy.info
    for k in ("export_id", "backend", "dtype", "device", "runtime", "cameras", "state_dim", "action_dim",
              "max_action_dim", "chunk", "n_action_steps"):
        assert k in info, f"info lacks {k}: {info}"
    first = loop[0][1]
    assert (info["chunk"], info["action_dim"]) == first["action"].shape, info
    assert info["max_action_dim"] == first["noise"].shape[1], info

    worst_act = worst_model = 0.0
    walls, rust, over = [], [], []
    for rep in range(REPEATS):
        for obs, want in loop:
            noise = want["noise"]
            if rep == 0:
                a = policy.act(obs, noise=noise)
                worst_act = max(worst_act, worst(a, want["action"], "act"))
                m = policy.predict_action_chunk(obs, noise=noise)
                worst_model = max(worst_model, worst(m, want["model"][None], "predict_action_chunk"))
            t0 = time.perf_counter()
            c = policy.act_chunk(obs, noise=noise)
            wall = time.perf_counter() - t0
            walls.append(wall)
            rust.append(c.seconds)
            over.append(wall - c.seconds)
            if rep == 0:
                worst(c.actions, want["action"], "act_chunk.actions")
                worst(c.model, want["model"], "act_chunk.model")
                if not np.array_equal(c.tokens, want["tokens"]):
                    raise AssertionError(f"tokens: petite {c.tokens}, lerobot {want['tokens']}")
                if not np.array_equal(c.token_mask, want["token_mask"].astype(bool)):
                    raise AssertionError(f"token_mask: petite {c.token_mask}, lerobot {want['token_mask']}")

    # Fresh noise unless given: two calls without noise differ; a seed repeats.
    obs0, want0 = loop[0]
    assert not np.array_equal(policy.act(obs0), policy.act(obs0)), "two calls without noise gave the same chunk"
    assert np.array_equal(policy.act(obs0, seed=3), policy.act(obs0, seed=3)), "a seed did not repeat"
    # Array-likes numpy reads give the same chunk: CPU torch tensors, float64, lists, a batch of 1.
    import torch

    same = policy.act(obs0, noise=want0["noise"])
    likes = [
        {k: (torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v) for k, v in obs0.items()},
        {**obs0, "observation.state": obs0["observation.state"].astype(np.float64).tolist()},
        {**obs0, "observation.state": obs0["observation.state"].reshape(1, -1), "task": [obs0["task"]]},
        {**obs0, "timestamp": 0.5, "index": np.int64(3), "action": np.zeros(3, np.float32)},
    ]
    for o in likes:
        if not np.array_equal(policy.act(o, noise=want0["noise"][None]), same):
            raise AssertionError(f"an equivalent observation gave another chunk: {sorted(o)}")
    rtc_err, n_rtc = check_rtc(policy, rtc_goldens(d, loop), "petite.Policy")
    n_refused = refusals(policy, obs0, want0["noise"], want0["action"])
    queued = busy(d / "reference", obs0, want0["noise"], want0["action"])
    gap, secs = gil_released(policy, obs0, want0["noise"])
    if gap >= 0.5 * secs:
        raise AssertionError(
            f"another Python thread paused {gap * 1e3:.2f} ms during {secs * 1e3:.2f} ms in Policy::act: the GIL is held"
        )
    policy.close()
    try:
        policy.act(obs0, noise=want0["noise"])
    except RuntimeError as e:
        assert "closed" in str(e), e
    else:
        raise AssertionError("a closed policy acted")

    us = lambda xs: statistics.median(xs) * 1e6  # noqa: E731
    r = {
        "case": case,
        "observations": len(loop),
        "worst_act": worst_act,
        "worst_predict_action_chunk": worst_model,
        "calls_timed": len(walls),
        "median_call_us": us(walls),
        "median_rust_act_us": us(rust),
        "median_overhead_us": us(over),
        "p90_overhead_us": float(np.percentile(over, 90) * 1e6),
        "refusals": n_refused,
        "rtc_goldens": n_rtc,
        "worst_rtc": rtc_err,
        "queued_calls_checked": queued,
        "gil_longest_pause_ms": gap * 1e3,
        "gil_rust_ms": secs * 1e3,
    }
    print(
        f"petite-python: {case}: {len(loop)} observations through one petite.Policy: act within "
        f"{worst_act:.2e} × max(1, |a|) of lerobot's pipeline, predict_action_chunk within {worst_model:.2e} "
        f"(bound {BOUND:g}); tokens and masks identical; {n_rtc} RTC goldens of lerobot's within {rtc_err:.2e}; "
        f"{n_refused} bad calls refused by key; "
        f"petite.Busy with a full queue, {queued} calls of 4 threads each answered right; "
        f"per call {r['median_call_us']:.0f} µs of which Policy::act {r['median_rust_act_us']:.0f} µs: "
        f"overhead median {r['median_overhead_us']:.1f} µs, p90 {r['p90_overhead_us']:.1f} µs "
        f"({len(walls)} calls); another thread's longest pause during {secs * 1e3:.1f} ms in Policy::act "
        f"{gap * 1e3:.2f} ms (GIL released)",
        flush=True,
    )
    return r


def start_serve(petite_bin, export, *args: str) -> tuple[subprocess.Popen, str]:
    """`petite serve --dir EXPORT ARGS… --listen 127.0.0.1:0`: the process and the address it
    says it listens on (its first stdout line)."""
    server = subprocess.Popen(
        [str(petite_bin), "serve", "--dir", str(export), *args, "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = server.stdout.readline()
    if "listening on " not in line:
        server.kill()
        raise AssertionError(f"petite serve did not start: {line!r}")
    return server, line.split("listening on ", 1)[1].split()[0]


def serve_case(out: Path, case: str, petite_bin: Path) -> dict:
    """`petite.Client` against `petite serve` of the case's reference export."""
    d = out / case
    loop = observations(d / "loop.safetensors")
    local = petite.Policy(str(d / "reference"), device="cpu", seed=0)
    server, addr = start_serve(petite_bin, d / "reference", "--seed", "0")
    try:
        client = petite.Client(addr, timeout=60.0)
        assert client.healthy()
        info = client.info
        for k, v in local.info.items():
            assert info[k] == v, f"Client.info[{k!r}] = {info[k]!r}, the Policy's {v!r}"
        assert info["queue"] >= 1 and info["max_message_bytes"] > 0, info

        rounds, server_ms, worst_act = [], [], 0.0
        for rep in range(REPEATS):
            for obs, want in loop:
                noise = want["noise"]
                t0 = time.perf_counter()
                c = client.act_chunk(obs, noise=noise)
                wall = time.perf_counter() - t0
                rounds.append(wall)
                server_ms.append(c.server_ms)
                if rep == 0:
                    mine = local.act_chunk(obs, noise=noise)
                    for what in ("actions", "model", "tokens", "token_mask"):
                        if not np.array_equal(getattr(c, what), getattr(mine, what)):
                            raise AssertionError(f"Client.{what} differs from the in-process Policy's")
                    worst_act = max(worst_act, worst(c.actions, want["action"], "Client.act_chunk"))
                    m = client.predict_action_chunk(obs, noise=noise)
                    worst(m, want["model"][None], "Client.predict_action_chunk")
        rtc_err, n_rtc = check_rtc(client, rtc_goldens(d, loop), "petite.Client")
        obs0, want0 = loop[0]
        state_key = "observation.state"
        try:
            client.act({**obs0, state_key: np.zeros(info["state_dim"] + 1, np.float32)}, noise=want0["noise"])
        except ValueError as e:
            assert f"`{state_key}`" in str(e), e
        else:
            raise AssertionError("the server accepted a state of the wrong width")

        errors, counts = [], [0] * 4

        def caller(k: int):
            try:
                for i in range(10):
                    obs, want = loop[(k + i) % len(loop)]
                    a = client.act(obs, noise=want["noise"])
                    if not np.array_equal(a, local.act(obs, noise=want["noise"])):
                        raise AssertionError(f"thread {k}, call {i}: another observation's answer")
                    counts[k] += 1
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise AssertionError(f"concurrent clients: {errors[0]}")
        server.send_signal(signal.SIGTERM)
        rc = server.wait(timeout=60)
        if rc != 0:
            raise AssertionError(f"petite serve exited {rc} after SIGTERM")
        try:
            client.act(obs0, noise=want0["noise"])
        except ConnectionError:
            pass
        else:
            raise AssertionError("a call to a stopped server succeeded")
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        local.close()
    over = [w - s / 1e3 for w, s in zip(rounds, server_ms)]
    r = {
        "case": case,
        "calls_timed": len(rounds),
        "median_round_trip_us": statistics.median(rounds) * 1e6,
        "median_server_us": statistics.median(server_ms) * 1e3,
        "median_transport_us": statistics.median(over) * 1e6,
        "p90_transport_us": float(np.percentile(over, 90) * 1e6),
        "concurrent_calls_checked": sum(counts),
        "rtc_goldens": n_rtc,
        "worst_rtc": rtc_err,
        "worst_act": worst_act,
    }
    print(
        f"petite-python: {case}: petite.Client over petite serve (loopback): {len(rounds)} calls equal to the "
        f"in-process Policy's bit for bit (lerobot within {worst_act:.2e}); {n_rtc} RTC goldens within "
        f"{rtc_err:.2e}; a bad state refused by key; "
        f"{sum(counts)} calls of 4 threads on one client each answered right; round trip median "
        f"{r['median_round_trip_us']:.0f} µs of which the server's {r['median_server_us']:.0f} µs: transport "
        f"median {r['median_transport_us']:.0f} µs, p90 {r['p90_transport_us']:.0f} µs; SIGTERM: exit 0, "
        f"then ConnectionError",
        flush=True,
    )
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--petite", required=True, type=Path, help="the petite binary (for petite serve)")
    ap.add_argument("cases", nargs="+")
    args = ap.parse_args()
    results = [run_case(args.out, c) for c in args.cases]
    results += [serve_case(args.out, c, args.petite) for c in args.cases]
    print("petite-python: " + json.dumps({"petite": petite.__version__, "cases": results}), flush=True)


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"petite-python: FAILED: {e}", file=sys.stderr)
        sys.exit(1)
