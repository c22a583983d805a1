#!/usr/bin/env python3
"""Milliseconds per action chunk of lerobot 0.6.1's real PI05 ``sample_actions`` on a CUDA GPU.

The GPU counterpart of bench_sample_actions.py (which times the CPU): the baseline petite-cuda's
``cargo xtask bench gpu`` is compared with — same weights (petite's synthetic full-size checkpoint,
``petite pi05 synth``), same sizes, same GPU, same run.

    bench_sample_actions_gpu.py --checkpoint model.safetensors [--config config.json]
        [--dtype bfloat16|float32] [--runs 20] [--warmup 3] [--device cuda]
        [--compile [--compile-mode reduce-overhead] [--compile-warmup 3]] [--no-eager]
        [--json-out results.jsonl] [--inputs inputs.safetensors [--expected expected.safetensors]]

Without ``--config`` the model is the real pi0.5 (lerobot defaults: 3 cameras of 224², 200
tokens (48 real, the rest padding), chunk 50, action dim 32, 10 steps), built the way
bench_sample_actions.py builds it; weights are copied one tensor at a time from the checkpoint
(lerobot 0.6.1 layout) into parameters already on the GPU, converted to the policy's dtype
(lerobot's own bfloat16 mode: ``PI05Config(dtype="bfloat16")``).

Each mode prints one JSON line (and appends it to ``--json-out``):
  * ``eager``: ``PI05Pytorch.sample_actions`` as lerobot runs it;
  * ``compiled``: the same method wrapped exactly as lerobot's ``compile_model=True`` wraps it
    (``torch.set_float32_matmul_precision("high")``; ``torch.compile(sample_actions,
    mode=...)``), default ``mode="reduce-overhead"`` (CUDA graphs). Its warm-up calls' wall times
    include the compilation; the compiled actions are compared with the eager ones (same noise).

Latency: CUDA events around each call on the current stream (median and spread of ``--runs``
chunks after ``--warmup`` untimed ones; the host's launch time and any host sync inside lerobot's
code lie between the two events, so they are counted), plus host wall time. Memory: the weights
resident on the device (parameters + buffers) and ``torch.cuda.max_memory_allocated()`` since the
last reset (reset right after loading, and again before the compiled mode's warm-up), i.e. the
caching allocator's peak of live tensors, CUDA-graph pools included; ``max_memory_reserved()`` too.
``--device cpu`` exists only to smoke-test this script on a small config without a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from transformers.initialization import no_init_weights

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_sample_actions as cpu_bench  # noqa: E402  (same directory)
import make_pi05_goldens as goldens  # noqa: E402

GIB = 1 << 30


def build(case: goldens.Case, dtype: str, device: str, small: bool):
    with no_init_weights():
        if small:
            policy = goldens.build_policy(case, dtype)
        else:
            size = case.vision.image_size
            config = goldens.PI05Config(
                dtype=dtype,
                device=device,
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
    policy.to(device)
    policy.eval()
    return policy


def device_inputs(inputs: dict[str, torch.Tensor], device: str):
    cams = inputs["images"].shape[0]
    images = [inputs["images"][c : c + 1].to(device) for c in range(cams)]
    img_masks = [inputs["image_masks"][c : c + 1].bool().to(device) for c in range(cams)]
    tokens = inputs["tokens"][None, :].to(device)
    masks = inputs["token_mask"][None, :].bool().to(device)
    noise = inputs["noise"][None, :, :].to(device)
    return images, img_masks, tokens, masks, noise


def timed(fn, warmup: int, runs: int, cuda: bool, mark_step: bool):
    """(warm-up wall seconds, per-chunk event ms, per-chunk wall ms, last output)."""

    def call():
        if mark_step:
            torch.compiler.cudagraph_mark_step_begin()
        return fn().clone()

    warm = []
    out = None
    for _ in range(warmup):
        s = time.perf_counter()
        out = call()
        if cuda:
            torch.cuda.synchronize()
        warm.append(time.perf_counter() - s)
        print(f"  warm-up chunk {len(warm)}: {warm[-1]:.3f} s wall", file=sys.stderr, flush=True)
    ev, wall = [], []
    for _ in range(runs):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            s = time.perf_counter()
            a.record()
            out = call()
            b.record()
            b.synchronize()
            wall.append((time.perf_counter() - s) * 1e3)
            ev.append(a.elapsed_time(b))
        else:
            s = time.perf_counter()
            out = call()
            wall.append((time.perf_counter() - s) * 1e3)
            ev.append(wall[-1])
    return warm, ev, wall, out


def summary(mode: str, args, warm, ev, wall, out, extra: dict) -> dict:
    cuda = args.device.startswith("cuda")
    r = {
        "mode": mode,
        "dtype": args.dtype,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "lerobot": goldens.lerobot.__version__,
        "transformers": transformers.__version__,
        "warmup": len(warm),
        "warmup_wall_s": [round(w, 3) for w in warm],
        "runs": len(ev),
        "median_chunk_ms": round(statistics.median(ev), 3),
        "min_chunk_ms": round(min(ev), 3),
        "max_chunk_ms": round(max(ev), 3),
        "median_wall_ms": round(statistics.median(wall), 3),
        "chunk_ms": [round(x, 3) for x in ev],
        "max_abs_actions": float(out.float().abs().max()),
    }
    if cuda:
        r["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
        r["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 3)
    r.update(extra)
    return r


def emit(r: dict, path: Path | None) -> None:
    line = json.dumps(r)
    print(line, flush=True)
    if path:
        with path.open("a") as f:
            f.write(line + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, type=Path)
    p.add_argument("--config", type=Path, help="petite config.json (default: the real pi0.5)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-eager", action="store_true", help="skip the eager mode")
    p.add_argument("--compile", action="store_true", help="also time lerobot's torch.compile path")
    p.add_argument("--compile-mode", default="reduce-overhead")
    p.add_argument("--compile-warmup", type=int, default=3)
    p.add_argument("--json-out", type=Path)
    p.add_argument("--inputs", type=Path, help="petite inputs.safetensors (default: seeded)")
    p.add_argument("--expected", type=Path, help="expected.safetensors to check eager actions against")
    args = p.parse_args()
    if args.expected and not args.inputs:
        p.error("--expected needs --inputs")

    torch.set_grad_enabled(False)
    cuda = args.device.startswith("cuda")
    case = cpu_bench.case_from_config(args.config) if args.config else cpu_bench.REAL

    t0 = time.perf_counter()
    policy = build(case, args.dtype, args.device, small=args.config is not None)
    t_build = time.perf_counter() - t0
    cpu_bench.load(policy, args.checkpoint)
    if cuda:
        torch.cuda.synchronize()
    t_load = time.perf_counter() - t0 - t_build
    model = policy.model
    weight_bytes = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    dtypes = sorted({str(t.dtype) for t in model.parameters()})
    inputs = cpu_bench.read_inputs(args.inputs) if args.inputs else goldens.make_inputs(case)
    images, img_masks, tokens, masks, noise = device_inputs(inputs, args.device)

    def chunk():
        return model.sample_actions(images, img_masks, tokens, masks, noise=noise.clone(), num_steps=case.steps)

    common = {
        "model": case.name,
        "build_s": round(t_build, 2),
        "load_s": round(t_load, 2),
        "weight_gib": round(weight_bytes / GIB, 3),
        "param_dtypes": dtypes,
        "steps": case.steps,
        "chunk": case.chunk,
        "tokens": case.tokens,
        "cameras": case.cameras,
    }
    eager_out = None
    if not args.no_eager:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        print("eager:", file=sys.stderr, flush=True)
        warm, ev, wall, eager_out = timed(chunk, args.warmup, args.runs, cuda, mark_step=False)
        extra = dict(common)
        if args.expected:
            with safe_open(str(args.expected), framework="pt") as f:
                want = f.get_tensor("actions" if args.dtype == "float32" else "actions_bf16")
            extra["max_abs_diff_vs_expected"] = float((eager_out[0].float().cpu() - want).abs().max())
        emit(summary("eager", args, warm, ev, wall, eager_out, extra), args.json_out)

    if args.compile:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        # Exactly what PI05Pytorch.__init__ does when config.compile_model is set.
        torch.set_float32_matmul_precision("high")
        model.sample_actions = torch.compile(model.sample_actions, mode=args.compile_mode)
        print(f"compiled ({args.compile_mode}):", file=sys.stderr, flush=True)
        mark = cuda and args.compile_mode in ("reduce-overhead", "max-autotune")
        warm, ev, wall, out = timed(chunk, args.compile_warmup, args.runs, cuda, mark_step=mark)
        extra = dict(common, compile_mode=args.compile_mode)
        if eager_out is not None:
            extra["max_abs_diff_vs_eager"] = float((out.float() - eager_out.float()).abs().max())
        emit(summary("compiled", args, warm, ev, wall, out, extra), args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
