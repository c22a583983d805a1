"""The ``petite`` policy: lerobot's policy interface over a ``petite.Policy``.

lerobot's processors (loaded from the export directory) run around it, as around PI05:
``predict_action_chunk`` takes the *preprocessed* batch (camera images, the prompt's tokens and
attention mask) and returns the model-space chunk (normalized, ``[1, chunk, action_dim]``),
computed by petite's exported programs (``petite.Policy.predict_action_chunk_model``); resizing,
padding and empty cameras happen inside petite as inside PI05. ``select_action`` keeps PI05's
action queue (``n_action_steps`` actions a chunk).
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import numpy as np
import petite
import torch
from lerobot.policies.pretrained import PreTrainedPolicy

from .configuration_petite import INFERENCE_ONLY, PetiteConfig

TOKENS = "observation.language.tokens"
MASK = "observation.language.attention_mask"
IMAGES = "observation.images."
RTC_KEYS = ("inference_delay", "prev_chunk_left_over", "execution_horizon")


def _numpy(key: str, v, floating: bool) -> np.ndarray:
    """A batch entry as a CPU numpy array (torch tensors moved off the device; floats as
    float32, which bfloat16 has no numpy form of)."""
    if isinstance(v, torch.Tensor):
        v = v.detach()
        if floating and v.is_floating_point():
            v = v.to(torch.float32)
        return v.cpu().numpy()
    return np.asarray(v)


def _petite_device(device: str | None) -> str:
    if device is None or device == "cpu":
        return "cpu"
    if device in ("cuda", "cuda:0"):
        return "cuda"
    raise ValueError(f"device: petite runs on \"cpu\" or \"cuda\", not {device!r}")


class PetitePolicy(PreTrainedPolicy):
    """A pi0.5 policy exported by petite, as a lerobot policy (inference only).

    Open it with :meth:`from_pretrained` on the export directory (lerobot's ``--policy.path``).
    """

    config_class = PetiteConfig
    name = "petite"

    def __init__(self, config: PetiteConfig, export_dir: str | Path | None = None, **kwargs):
        super().__init__(config)
        export_dir = export_dir if export_dir is not None else config.pretrained_path
        if export_dir is None:
            raise ValueError(
                "a petite policy is an export: open it with PetitePolicy.from_pretrained(EXPORT_DIR)"
            )
        self.export_dir = Path(export_dir)
        self.petite = petite.Policy(
            str(self.export_dir),
            device=_petite_device(config.device),
            tokenizer=config.tokenizer,
            python=config.python,
            seed=config.seed,
            queue=config.queue,
        )
        info = self.petite.info
        if info["chunk"] != config.chunk_size:
            raise ValueError(
                f"{self.export_dir}: config.json says chunk_size {config.chunk_size}, the export's programs {info['chunk']}"
            )
        action = config.output_features.get("action") if config.output_features else None
        if action is not None and tuple(action.shape) != (info["action_dim"],):
            raise ValueError(
                f"{self.export_dir}: config.json's action shape {tuple(action.shape)}, the export's {info['action_dim']}"
            )
        self.reset()

    @classmethod
    def from_pretrained(
        cls,
        pretrained_name_or_path: str | Path,
        *,
        config: PetiteConfig | None = None,
        device: str | None = None,
        **kwargs,
    ) -> PetitePolicy:
        """Opens the export in ``pretrained_name_or_path`` (a local folder ``petite export``
        wrote from a lerobot policy folder). ``config``: its config as lerobot parsed it (else
        read from the folder's ``config.json``); ``device``: ``"cpu"`` or ``"cuda"`` (else the
        config's). lerobot's other loading arguments (revision, dataset stats, …) do not apply
        to an export and are ignored."""
        path = Path(pretrained_name_or_path)
        if not path.is_dir():
            raise FileNotFoundError(
                f"{path}: not a folder; a petite policy is a local export (`petite export --checkpoint <lerobot folder> --out DIR`)"
            )
        if config is None:
            config = PetiteConfig.from_pretrained(path)
        if not isinstance(config, PetiteConfig):
            raise ValueError(f"{path}: config.json is a {type(config).__name__}, not a petite export's")
        if device is not None:
            config.device = device
        config.pretrained_path = path
        policy = cls(config, export_dir=path)
        policy.eval()
        return policy

    def supports_rtc(self) -> bool:
        return True

    def init_rtc_processor(self) -> None:
        """lerobot's rollout sets ``config.rtc_config`` and calls this: the options are read
        from the config at every call, so there is nothing to rebuild."""

    def _rtc_enabled(self) -> bool:
        return self.config.rtc_config is not None and self.config.rtc_config.enabled

    def get_optim_params(self) -> dict:
        raise NotImplementedError(INFERENCE_ONLY)

    def forward(self, batch, reduction: str = "mean"):
        raise NotImplementedError(INFERENCE_ONLY)

    def reset(self) -> None:
        """Empties the action queue (lerobot calls it when the environment resets)."""
        self._action_queue = deque(maxlen=self.config.n_action_steps)

    def _rtc_call_kwargs(self, rtc: dict) -> dict:
        """THE PLACE WHERE RTC IS WIRED: lerobot's RTC arguments (``inference_delay``,
        ``prev_chunk_left_over`` in model space, ``execution_horizon``) and the config's
        ``rtc_config`` as the keyword arguments of ``petite.Policy.predict_action_chunk_model``.
        As PI05, RTC applies only when ``config.rtc_config.enabled`` and a leftover is given."""
        prev = rtc.get("prev_chunk_left_over")
        if prev is None or not self._rtc_enabled():
            return {}
        c = self.config.rtc_config
        horizon = rtc.get("execution_horizon")
        return {
            "prev_chunk_left_over": _numpy("prev_chunk_left_over", prev, True),
            "inference_delay": rtc.get("inference_delay"),
            "execution_horizon": c.execution_horizon if horizon is None else horizon,
            "prefix_attention_schedule": str(getattr(c.prefix_attention_schedule, "value", c.prefix_attention_schedule)),
            "max_guidance_weight": c.max_guidance_weight,
        }

    @torch.no_grad()
    def predict_action_chunk(self, batch: dict, noise=None, **kwargs) -> torch.Tensor:
        """The model-space chunk (normalized, ``[1, chunk, action_dim]`` float32) for a batch
        from lerobot's preprocessor, as PI05's ``predict_action_chunk``: ``noise`` the flow's
        starting noise (``[1, chunk, max_action_dim]``; else fresh noise each call); RTC
        keywords (``inference_delay``, ``prev_chunk_left_over``, ``execution_horizon``) as
        PI05 takes them. On the device of the batch's tokens."""
        unknown = set(kwargs) - set(RTC_KEYS)
        if unknown:
            raise TypeError(f"predict_action_chunk: unexpected arguments {sorted(unknown)}")
        extra = self._rtc_call_kwargs(kwargs)
        arrays = {}
        for k, v in batch.items():
            if k.startswith(IMAGES):
                arrays[k] = _numpy(k, v, True)
            elif k in (TOKENS, MASK):
                arrays[k] = _numpy(k, v, False)
        n = None if noise is None else _numpy("noise", noise, True)
        out = self.petite.predict_action_chunk_model(arrays, noise=n, **extra)
        device = batch[TOKENS].device if isinstance(batch.get(TOKENS), torch.Tensor) else "cpu"
        return torch.from_numpy(out).to(device)

    @torch.no_grad()
    def select_action(self, batch: dict, **kwargs) -> torch.Tensor:
        """One action (model space, ``[1, action_dim]``) from the queue, refilled with the first
        ``n_action_steps`` actions of a new chunk when empty — PI05's ``select_action``."""
        if self._rtc_enabled():
            raise ValueError("RTC is not supported for select_action, use it with predict_action_chunk")
        if len(self._action_queue) == 0:
            actions = self.predict_action_chunk(batch, **kwargs)[:, : self.config.n_action_steps]
            self._action_queue.extend(actions.transpose(0, 1))
        return self._action_queue.popleft()

