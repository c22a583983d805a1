#!/usr/bin/env python3
"""Real lerobot 0.6.1 pi0.5 policy folders, and what lerobot's whole pipeline does with them.

For each case below this script
  1. trains a small tokenizer with HF `tokenizers` on Gemma's conventions (pad 0, eos 1, bos 2
     prepended, Metaspace), standing in for the gated PaliGemma one, and saves it with
     transformers' `save_pretrained` (so `AutoTokenizer` loads it as lerobot does);
  2. builds lerobot's own PI05Policy at small sizes (the golden generator's `small_model`),
     seeds its weights, and saves the folder as a user gets it: `policy.save_pretrained` and the
     pre/post-processors' `save_pretrained` (made by lerobot's `make_pi05_pre_post_processors`
     with dataset stats; the tokenizer step pointed at the small tokenizer);
  3. optionally turns it into a Hub-style folder: a hand-written config.json missing fields,
     weights without the `model.` prefix and without `embed_tokens` (the embedding under
     `paligemma.lm_head`);
  4. loads the folder back with `PI05Policy.from_pretrained` and runs lerobot's preprocessor →
     `predict_action_chunk` (fixed noise) → postprocessor on raw observations (non-square images
     at another size, float CHW and uint8 HWC, a camera left out);
  5. writes, per case: the folder (`policy/`), `petite.json` (the model sizes in petite's schema,
     since lerobot's config can only name the real variants), `observation.safetensors` (lerobot's
     keys, the noise, metadata `task`) and `expected.safetensors` (`action`, tokens, mask);
  6. runs the same pipeline on a loop of LOOP further observations (tasks, images, states and
     noise all varying; some with a leading batch dimension of 1, some images uint8 where the
     first was float) and writes `loop.safetensors`: per observation `NN/<lerobot key>`,
     `NN/noise`, lerobot's `NN/action` (postprocessed), `NN/model` (`predict_action_chunk`'s
     output) and `NN/tokens`, `NN/token_mask`; metadata `tasks` (a JSON list). The Python
     package's test (`python_policy.py`) calls one `petite.Policy` over them. Then the same
     observations through lerobot's `select_action` (its action queue), the chunk drawn at
     observation NN from `NN/noise`: `NN/select_action` and `NN/select_action_post` (after the
     postprocessor), for the lerobot plugin's test (`plugin_policy.py`).

Usage: make_policy_folders.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file as save_np
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_pi05_goldens as g  # noqa: E402

from lerobot.configs import FeatureType, NormalizationMode, PolicyFeature  # noqa: E402
from lerobot.policies.pi05 import processor_pi05  # noqa: E402
from lerobot.policies.pi05.configuration_pi05 import PI05Config  # noqa: E402
from lerobot.policies.pi05.modeling_pi05 import PI05Policy  # noqa: E402

VOCAB = 320  # model rows; the tokenizer uses fewer
LOOP = 24  # observations of the loop (step 6)
TASKS = ["pick up the red cube", "open the drawer", "stack blocks", "put the bowl on the plate\n", "close blue drawer"]


@dataclass(frozen=True)
class Case:
    name: str
    seed: int
    resolution: int
    patch: int
    cameras: tuple  # (key, raw (H, W), "f32" | "u8" | None (left out of the observation))
    empty_cameras: int
    state_dim: int
    action_dim: int
    max_action_dim: int
    chunk: int
    n_action_steps: int
    tokens: int
    steps: int
    norm: str
    hub: bool
    task: str
    relative: bool = False


CASES = [
    # LIBERO-like: 2 real cameras + 1 empty, raw images non-square and not at the resolution
    # (one float CHW, one uint8 HWC), MEAN_STD, state 5 != action 4 != max 6 != 32, chunk 7,
    # tokens 48, steps 5; relative actions with the gripper excluded.
    Case(
        name="libero_like_mean_std",
        seed=7001,
        resolution=28,
        patch=7,
        cameras=(("image", (30, 44), "f32"), ("image2", (36, 20), "u8")),
        empty_cameras=1,
        state_dim=5,
        action_dim=4,
        max_action_dim=6,
        chunk=7,
        n_action_steps=3,
        tokens=48,
        steps=5,
        norm="MEAN_STD",
        hub=False,
        task="put the_bowl on the plate\n",
        relative=True,
    ),
    # Hub-style folder: hand-written config (no normalization_mapping → QUANTILES, no
    # empty_camera entry), no `model.` prefix, no embed_tokens; a real camera left out of the
    # observation (masked); tokens truncate (9 < the prompt's 11).
    Case(
        name="hub_quantiles",
        seed=7002,
        resolution=24,
        patch=8,
        cameras=(("base_0_rgb", (24, 24), "f32"), ("wrist_0_rgb", (24, 24), None), ("side", (50, 30), "f32")),
        empty_cameras=1,
        state_dim=3,
        action_dim=3,
        max_action_dim=5,
        chunk=4,
        n_action_steps=4,
        tokens=9,
        steps=3,
        norm="QUANTILES",
        hub=True,
        task="stack blocks",
    ),
]


def train_tokenizer(out: Path) -> Path:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    corpus = []
    rng = np.random.Generator(np.random.PCG64(5))
    words = "put the bowl on plate stack blocks pick up cube open drawer close red blue Task State Action".split()
    for _ in range(400):
        task = " ".join(rng.choice(words, size=4))
        state = " ".join(str(int(b)) for b in rng.integers(-1, 256, size=6))
        corpus.append(f"Task: {task}, State: {state};\nAction: ")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"])
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    assert tok.token_to_id("<pad>") == 0 and tok.token_to_id("<eos>") == 1 and tok.token_to_id("<bos>") == 2
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out


def stats(rng, dim):
    lo = rng.uniform(-2.0, 0.0, size=dim).astype(np.float32)
    hi = lo + rng.uniform(0.5, 3.0, size=dim).astype(np.float32)
    return {
        "mean": torch.from_numpy(((lo + hi) / 2).astype(np.float32)),
        "std": torch.from_numpy(rng.uniform(0.2, 1.5, size=dim).astype(np.float32)),
        "min": torch.from_numpy(lo - 0.1),
        "max": torch.from_numpy(hi + 0.1),
        "q01": torch.from_numpy(lo),
        "q99": torch.from_numpy(hi),
        "q10": torch.from_numpy(lo + 0.05),
        "q90": torch.from_numpy(hi - 0.05),
    }


def sizes(case: Case) -> g.Case:
    return g.Case(
        name=case.name,
        seed=case.seed,
        vision=g.Vision(image_size=case.resolution, patch_size=case.patch, hidden=24, layers=2, heads=2, mlp=40),
        language=g.Gemma(width=32, depth=2, heads=4, kv_heads=1, head_dim=8, mlp=48),
        expert=g.Gemma(width=16, depth=2, heads=4, kv_heads=1, head_dim=8, mlp=24),
        vocab=VOCAB,
        cameras=len(case.cameras) + case.empty_cameras,
        tokens=case.tokens,
        chunk=case.chunk,
        action_dim=case.max_action_dim,
        real_tokens=case.tokens,
        steps=case.steps,
    )


def make_case(case: Case, out: Path, tokdir: Path) -> None:
    sz = sizes(case)
    res = case.resolution
    rng = np.random.Generator(np.random.PCG64(case.seed))
    norm = NormalizationMode(case.norm)
    config = PI05Config(
        device="cpu",
        dtype="float32",
        chunk_size=case.chunk,
        n_action_steps=case.n_action_steps,
        max_action_dim=case.max_action_dim,
        max_state_dim=8,
        num_inference_steps=case.steps,
        image_resolution=(res, res),
        tokenizer_max_length=case.tokens,
        empty_cameras=case.empty_cameras,
        use_relative_actions=case.relative,
        relative_exclude_joints=["gripper"],
        action_feature_names=["x", "y", "z", "gripper"][: case.action_dim] if case.relative else None,
        normalization_mapping={"VISUAL": NormalizationMode.IDENTITY, "STATE": norm, "ACTION": norm},
        input_features={
            **{
                f"observation.images.{k}": PolicyFeature(type=FeatureType.VISUAL, shape=(3, h, w))
                for k, (h, w), _ in case.cameras
            },
            "observation.state": PolicyFeature(type=FeatureType.STATE, shape=(case.state_dim,)),
        },
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(case.action_dim,))},
    )
    with g.small_model(sz):
        policy = PI05Policy(config)
    policy.eval()
    policy.load_state_dict(g.seeded_state_dict(policy, case.seed))
    folder = out / "policy"
    policy.save_pretrained(str(folder))

    dataset_stats = {"observation.state": stats(rng, case.state_dim), "action": stats(rng, case.action_dim)}
    orig_step = processor_pi05.TokenizerProcessorStep

    def local_tokenizer(**kw):
        kw["tokenizer_name"] = str(tokdir)
        return orig_step(**kw)

    processor_pi05.TokenizerProcessorStep = local_tokenizer
    try:
        pre, post = processor_pi05.make_pi05_pre_post_processors(policy.config, dataset_stats=dataset_stats)
    finally:
        processor_pi05.TokenizerProcessorStep = orig_step
    pre.save_pretrained(str(folder))
    post.save_pretrained(str(folder))

    if case.hub:
        # As the Hub's converted folders: hand-written config, openpi key names.
        hand = {
            "type": "pi05",
            "input_features": {
                **{f"observation.images.{k}": {"type": "VISUAL", "shape": [3, h, w]} for k, (h, w), _ in case.cameras},
                "observation.state": {"type": "STATE", "shape": [case.state_dim]},
            },
            "output_features": {"action": {"type": "ACTION", "shape": [case.action_dim]}},
            "device": "cpu",
            "chunk_size": case.chunk,
            "n_action_steps": case.n_action_steps,
            "max_action_dim": case.max_action_dim,
            "max_state_dim": 8,
            "num_inference_steps": case.steps,
            "image_resolution": [res, res],
            "tokenizer_max_length": case.tokens,
            "empty_cameras": case.empty_cameras,
        }
        assert case.norm == "QUANTILES"  # the default a config without normalization_mapping gets
        (folder / "config.json").write_text(json.dumps(hand, indent=2))
        sd = load_file(str(folder / "model.safetensors"))
        embed = sd.pop("model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight")
        sd["model.paligemma_with_expert.paligemma.lm_head.weight"] = embed
        sd = {k.removeprefix("model."): v.contiguous() for k, v in sd.items()}
        save_file(sd, str(folder / "model.safetensors"))

    # lerobot reads the folder back as a user's run would.
    with g.small_model(sz):
        policy = PI05Policy.from_pretrained(str(folder))
    policy.eval()

    obs_np = {}
    obs_torch = {}
    for k, (h, w), kind in case.cameras:
        key = f"observation.images.{k}"
        if kind == "f32":
            img = rng.uniform(0.0, 1.0, size=(3, h, w)).astype(np.float32)
            obs_np[key] = img
            obs_torch[key] = torch.from_numpy(img)[None]
        elif kind == "u8":
            img = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
            obs_np[key] = img
            obs_torch[key] = (torch.from_numpy(img).permute(2, 0, 1).float() / 255.0)[None]
    state = (dataset_stats["observation.state"]["mean"].numpy() + rng.uniform(-1.0, 1.0, size=case.state_dim)).astype(
        np.float32
    )
    obs_np["observation.state"] = state
    obs_torch["observation.state"] = torch.from_numpy(state)[None]
    noise = rng.standard_normal((case.chunk, case.max_action_dim), dtype=np.float32)
    obs_np["noise"] = noise
    obs_torch["task"] = [case.task]

    with torch.no_grad():
        batch = pre(obs_torch)
        actions = policy.predict_action_chunk(batch, noise=torch.from_numpy(noise)[None].clone())
        actions = post(actions)
    tokens = batch["observation.language.tokens"][0].numpy().astype(np.int64)
    mask = batch["observation.language.attention_mask"][0].numpy().astype(np.uint8)
    a = actions[0].numpy().astype(np.float32)
    assert a.shape == (case.chunk, case.action_dim) and np.isfinite(a).all(), a.shape
    assert tokens.max() < VOCAB

    save_np(obs_np, str(out / "observation.safetensors"), metadata={"task": case.task})
    save_np({"action": a, "tokens": tokens, "token_mask": mask}, str(out / "expected.safetensors"))
    petite = g.petite_config(sz, policy)
    (out / "petite.json").write_text(json.dumps(petite, indent=2))
    make_loop(case, policy, pre, post, dataset_stats, out)
    print(
        f"{case.name}: tokens {int(mask.sum())}/{case.tokens}, actions {a.shape}, max |a| {np.abs(a).max():.3f}",
        flush=True,
    )


def make_loop(case: Case, policy, pre, post, dataset_stats, out: Path) -> None:
    """Step 6: LOOP observations through lerobot's pipeline, one at a time as a robot sends them."""
    rng = np.random.Generator(np.random.PCG64(case.seed + 1))
    tensors = {}
    tasks = []
    obs_loop = []
    for i in range(LOOP):
        p = f"{i:02d}/"
        obs_torch = {}
        batched = i % 4 == 3  # a leading batch dimension of 1 in the numpy arrays too
        for j, (k, (h, w), kind) in enumerate(case.cameras):
            key = f"observation.images.{k}"
            if kind is None:
                continue
            # Alternate float CHW and uint8 HWC per observation and camera.
            if (i + j) % 2 == 0:
                img = rng.uniform(0.0, 1.0, size=(3, h, w)).astype(np.float32)
                t = torch.from_numpy(img)
            else:
                img = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
                t = torch.from_numpy(img).permute(2, 0, 1).float() / 255.0
            tensors[p + key] = img[None] if batched else img
            obs_torch[key] = t[None]
        state = (
            dataset_stats["observation.state"]["mean"].numpy() + rng.uniform(-1.5, 1.5, size=case.state_dim)
        ).astype(np.float32)
        tensors[p + "observation.state"] = state[None] if batched else state
        obs_torch["observation.state"] = torch.from_numpy(state)[None]
        noise = rng.standard_normal((case.chunk, case.max_action_dim), dtype=np.float32)
        tensors[p + "noise"] = noise
        task = TASKS[i % len(TASKS)]
        tasks.append(task)
        obs_torch["task"] = [task]
        obs_loop.append(dict(obs_torch))
        with torch.no_grad():
            batch = pre(obs_torch)
            model = policy.predict_action_chunk(batch, noise=torch.from_numpy(noise)[None].clone())
            actions = post(model.clone())
        a = actions[0].numpy().astype(np.float32)
        m = model[0].numpy().astype(np.float32)
        assert a.shape == m.shape == (case.chunk, case.action_dim) and np.isfinite(a).all()
        tensors[p + "action"] = a
        tensors[p + "model"] = m
        tensors[p + "tokens"] = batch["observation.language.tokens"][0].numpy().astype(np.int64)
        tensors[p + "token_mask"] = batch["observation.language.attention_mask"][0].numpy().astype(np.uint8)
    select_loop(policy, pre, post, obs_loop, tensors)
    save_np(tensors, str(out / "loop.safetensors"), metadata={"tasks": json.dumps(tasks)})
    print(f"{case.name}: a loop of {LOOP} observations through lerobot's pipeline", flush=True)


def select_loop(policy, pre, post, obs_loop, tensors) -> None:
    """The same observations through lerobot's `select_action` (its action queue: a chunk every
    `n_action_steps` calls), PI05's noise for a chunk drawn at observation NN being `NN/noise`:
    `NN/select_action` (model space, `[action_dim]`) and `NN/select_action_post` (after the
    postprocessor), for the lerobot plugin's test."""
    current = {}
    original = policy.model.sample_noise
    policy.model.sample_noise = lambda shape, device: current["noise"].clone()
    try:
        policy.reset()
        for i, obs_torch in enumerate(obs_loop):
            p = f"{i:02d}/"
            current["noise"] = torch.from_numpy(tensors[p + "noise"])[None]
            with torch.no_grad():
                batch = pre(obs_torch)
                a = policy.select_action(batch)
                a_post = post(a.clone())
            assert a.shape == (1, a_post.shape[-1]) and torch.isfinite(a).all(), a.shape
            tensors[p + "select_action"] = a[0].numpy().astype(np.float32)
            tensors[p + "select_action_post"] = a_post[0].numpy().astype(np.float32)
    finally:
        policy.model.sample_noise = original
        policy.reset()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if args.out.exists():
        shutil.rmtree(args.out)
    tokdir = train_tokenizer(args.out / "tokenizer")
    for case in CASES:
        make_case(case, args.out / case.name, tokdir)


if __name__ == "__main__":
    main()
