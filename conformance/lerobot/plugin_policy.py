#!/usr/bin/env python3
"""The lerobot plugin (`lerobot_policy_petite`) against lerobot's PI05, through lerobot's own API
(the lerobot-policy tier).

With the plugin installed in the lerobot venv as a user installs it, for each case folder that
`make_policy_folders.py` wrote (and `petite export` exported to `<case>/reference`):
  - lerobot finds the plugin (`register_third_party_plugins`: type `petite` registered,
    `get_policy_class("petite")` is `PetitePolicy`), parses the export's `config.json`
    (`PreTrainedConfig.from_pretrained`) and opens it with `make_policy` (dataset features as
    a dataset would give them) and with `get_policy_class("petite").from_pretrained`;
  - `make_pre_post_processors(cfg, pretrained_path=EXPORT)` rebuilds the folder's own pipelines
    from the files the export copied (the tokens equal lerobot's for every observation);
  - `select_action` over the case's loop of LOOP observations (a chunk drawn every
    `n_action_steps` calls, from the noise lerobot's PI05 drew at that observation) equals
    lerobot's PI05 `select_action` within BOUND × max(1, |a|) per element, before and after the
    postprocessor; `predict_action_chunk(batch, noise=...)` equals PI05's;
  - `forward`/`get_optim_params` refused in one line; a batch of 2 refused naming the key and
    the policy usable afterwards; `supports_rtc()` and lerobot's RTC call shape (its rollout's `supports_rtc_inference`); and
    lerobot's RTC goldens (make_rtc_goldens.py) through the plugin with lerobot's RTCConfig and
    keywords, within the bound, each guided chunk far from the plain one.
A NaN or a shape mismatch fails. Prints one line per case; exits non-zero on any failure.

Usage: plugin_policy.py --out DIR CASE [CASE ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from safetensors import safe_open
from safetensors.numpy import load_file

BOUND = 1e-4


def worst(got, want: np.ndarray, what: str) -> float:
    got = got.detach().cpu().numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
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


def loop(path: Path):
    """The loop's raw observations as lerobot's pipeline got them (float CHW in [0, 1] with a
    batch dimension; uint8 HWC scaled by 1/255 as envs and datasets do) and lerobot's outputs."""
    t = load_file(str(path))
    with safe_open(str(path), "np") as f:
        tasks = json.loads(f.metadata()["tasks"])
    out = []
    for i, task in enumerate(tasks):
        p = f"{i:02d}/"
        obs = {}
        for k, v in t.items():
            if not k.startswith(p + "observation."):
                continue
            key = k[len(p) :]
            x = torch.from_numpy(v.copy())
            if key.startswith("observation.images."):
                if x.dtype == torch.uint8:
                    x = x.permute(*range(x.ndim - 3), x.ndim - 1, x.ndim - 3, x.ndim - 2).float() / 255.0
                if x.ndim == 3:
                    x = x[None]
            elif x.ndim == 1:
                x = x[None]
            obs[key] = x
        obs["task"] = [task]
        want = {k: t[p + k] for k in ("noise", "model", "tokens", "token_mask", "select_action", "select_action_post")}
        out.append((obs, want))
    return out


def dataset_meta(cfg):
    """What `make_policy` reads of a dataset's metadata: its features (images HWC as a dataset
    stores them), no stats (the processors carry them)."""
    feats = {}
    for k, ft in {**cfg.input_features, **cfg.output_features}.items():
        s = tuple(ft.shape)
        if ft.type.value == "VISUAL":
            feats[k] = {"dtype": "video", "shape": (s[1], s[2], s[0]), "names": ["height", "width", "channels"]}
        else:
            feats[k] = {"dtype": "float32", "shape": s, "names": None}
    return SimpleNamespace(features=feats, stats=None)


def rtc_call_shape(policy) -> bool:
    """lerobot's own check, as its rollout runs it before turning RTC on."""
    from lerobot.rollout.inference.rtc import supports_rtc_inference

    return supports_rtc_inference(policy)


def refused(fn, exc, words, what: str) -> str:
    try:
        fn()
    except exc as e:
        msg = str(e)
        for w in words:
            if w not in msg:
                raise AssertionError(f"{what}: the error does not say {w!r}: {msg}")
        if "\n" in msg:
            raise AssertionError(f"{what}: not one line: {msg}")
        return msg
    raise AssertionError(f"{what}: accepted")


def run_case(out: Path, case: str) -> dict:
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import get_policy_class, make_policy, make_pre_post_processors
    from lerobot.policies.rtc.configuration_rtc import RTCConfig

    d = out / case
    export = d / "reference"
    cls = get_policy_class("petite")
    if cls.__name__ != "PetitePolicy" or cls.__module__ != "lerobot_policy_petite.modeling_petite":
        raise AssertionError(f"get_policy_class('petite') is {cls.__module__}.{cls.__name__}")
    cfg = PreTrainedConfig.from_pretrained(export)
    if cfg.type != "petite":
        raise AssertionError(f"config type {cfg.type}")
    cfg.pretrained_path = export
    policy = make_policy(cfg, ds_meta=dataset_meta(cfg))
    if not isinstance(policy, cls):
        raise AssertionError(f"make_policy gave a {type(policy).__name__}")
    pre, post = make_pre_post_processors(cfg, pretrained_path=str(export))
    obs_loop = loop(d / "loop.safetensors")
    n = policy.config.n_action_steps

    # select_action, lerobot's queue: a chunk at observations 0, n, 2n, …, each from the noise
    # lerobot's PI05 drew at that observation.
    current = {}
    drawn = []
    plain = policy.predict_action_chunk

    def with_noise(batch, **kw):
        drawn.append(current["i"])
        return plain(batch, noise=torch.from_numpy(current["noise"])[None], **kw)

    policy.predict_action_chunk = with_noise
    policy.reset()
    w_sel = w_post = 0.0
    for i, (obs, want) in enumerate(obs_loop):
        current.update(i=i, noise=want["noise"])
        batch = pre(obs)
        if not np.array_equal(batch["observation.language.tokens"][0].numpy(), want["tokens"]):
            raise AssertionError(f"observation {i}: the export's preprocessor gave other tokens than lerobot's")
        a = policy.select_action(batch)
        w_sel = max(w_sel, worst(a, want["select_action"][None], f"select_action {i}"))
        w_post = max(w_post, worst(post(a), want["select_action_post"][None], f"select_action {i} postprocessed"))
    del policy.predict_action_chunk
    if drawn != list(range(0, len(obs_loop), n)):
        raise AssertionError(f"chunks drawn at observations {drawn}, lerobot's queue draws at every {n}th")

    # predict_action_chunk itself, and the same from from_pretrained.
    w_chunk = 0.0
    for obs, want in obs_loop[:6]:
        batch = pre(obs)
        m = policy.predict_action_chunk(batch, noise=torch.from_numpy(want["noise"])[None])
        w_chunk = max(w_chunk, worst(m, want["model"][None], "predict_action_chunk"))
    obs0, want0 = obs_loop[0]
    batch0 = pre(obs0)
    noise0 = torch.from_numpy(want0["noise"])[None]
    other = cls.from_pretrained(str(export))
    worst(other.predict_action_chunk(batch0, noise=noise0), want0["model"][None], "from_pretrained")
    other.petite.close()

    # Refusals, one line each; the policy answers afterwards.
    refused(lambda: policy.forward(batch0), NotImplementedError, ["inference only"], "forward")
    refused(lambda: policy.get_optim_params(), NotImplementedError, ["inference only"], "get_optim_params")
    cam = next(k for k in batch0 if k.startswith("observation.images."))
    two = {**batch0, cam: torch.cat([batch0[cam], batch0[cam]])}
    refused(lambda: policy.predict_action_chunk(two, noise=noise0), ValueError, [f"`{cam}`", "a batch of 2"], "a batch of 2 images")
    tk = "observation.language.tokens"
    two = {**batch0, tk: torch.cat([batch0[tk], batch0[tk]])}
    refused(lambda: policy.predict_action_chunk(two, noise=noise0), ValueError, [f"`{tk}`", "a batch of 2"], "a batch of 2 prompts")
    worst(policy.predict_action_chunk(batch0, noise=noise0), want0["model"][None], "after the refusals")

    # RTC: declared, lerobot's rollout accepts the call shape; with a leftover and RTC enabled
    # it runs or says why not.
    if not rtc_call_shape(policy):
        raise AssertionError("the policy does not take lerobot's RTC call shape")
    # lerobot's RTC goldens (make_rtc_goldens.py: every schedule, delays 0, 3 and past the
    # horizon, a leftover shorter than the chunk) through the plugin with lerobot's own
    # RTCConfig and predict_action_chunk keywords.
    from lerobot.configs import RTCAttentionSchedule
    from safetensors import safe_open
    from safetensors.numpy import load_file

    gpath = d / "rtc.safetensors"
    gt = load_file(str(gpath))
    with safe_open(str(gpath), "np") as f:
        meta = json.loads(f.metadata()["rtc"])
    w_rtc = 0.0
    for j, m in enumerate(meta):
        p = f"{j:02d}/"
        policy.config.rtc_config = RTCConfig(
            enabled=True,
            prefix_attention_schedule=RTCAttentionSchedule[m["schedule"]],
            max_guidance_weight=m["max_guidance_weight"],
            execution_horizon=m["execution_horizon"],
        )
        policy.init_rtc_processor()
        batch = pre(obs_loop[m["obs"]][0])
        got = policy.predict_action_chunk(
            batch,
            noise=torch.from_numpy(gt[p + "noise"])[None],
            inference_delay=m["inference_delay"],
            prev_chunk_left_over=torch.from_numpy(gt[p + "prev_chunk_left_over"])[None],
        )
        w_rtc = max(w_rtc, worst(got, gt[p + "model"][None], f"RTC golden {j} ({m['schedule']}, delay {m['inference_delay']})"))
        moved = float(np.abs(got.numpy()[0] - gt[p + "plain_model"]).max())
        if m["differs"] and moved <= 100 * BOUND:
            raise AssertionError(f"RTC golden {j}: the plugin's guided chunk is the plain one")
    rtc_note = f"{len(meta)} RTC goldens of lerobot's PI05 within {w_rtc:.2e}"
    # Without a leftover RTC is a plain chunk, as PI05's.
    worst(policy.predict_action_chunk(batch0, noise=noise0, inference_delay=1), want0["model"][None], "RTC without a leftover")
    refused(lambda: policy.select_action(batch0), ValueError, ["RTC"], "select_action with RTC on")
    policy.config.rtc_config = None
    policy.petite.close()

    r = {
        "case": case,
        "select_action_calls": len(obs_loop),
        "chunks": len(drawn),
        "worst_select_action": w_sel,
        "worst_select_action_post": w_post,
        "worst_predict_action_chunk": w_chunk,
        "rtc": rtc_note,
    }
    print(
        f"lerobot-plugin: {case}: make_policy(type petite) on the export, make_pre_post_processors from it: "
        f"select_action over {len(obs_loop)} observations ({len(drawn)} chunks, n_action_steps {n}) within "
        f"{w_sel:.2e} × max(1, |a|) of lerobot's PI05 (model space), {w_post:.2e} after the postprocessor; "
        f"predict_action_chunk within {w_chunk:.2e} (bound {BOUND:g}); tokens identical; forward refused; "
        f"a batch of 2 refused by key; {rtc_note}",
        flush=True,
    )
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("cases", nargs="+")
    args = ap.parse_args()
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.utils.import_utils import register_third_party_plugins

    if "petite" in PreTrainedConfig.get_known_choices():
        raise AssertionError("type petite registered before lerobot loaded its plugins")
    register_third_party_plugins()
    if "petite" not in PreTrainedConfig.get_known_choices():
        raise AssertionError("register_third_party_plugins did not register type petite: is lerobot_policy_petite installed?")
    results = [run_case(args.out, c) for c in args.cases]
    print("lerobot-plugin: " + json.dumps({"cases": results}), flush=True)


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"lerobot-plugin: FAILED: {e}", file=sys.stderr)
        sys.exit(1)
