"""The ``petite`` policy's lerobot config: what ``petite export`` writes as ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass

from lerobot.configs import PreTrainedConfig
from lerobot.policies.rtc.configuration_rtc import RTCConfig

INFERENCE_ONLY = (
    "a petite policy runs exported programs (inference only): train the lerobot pi05 policy, then export it again"
)


@PreTrainedConfig.register_subclass("petite")
@dataclass
class PetiteConfig(PreTrainedConfig):
    """An exported policy. ``input_features``/``output_features``, ``chunk_size``,
    ``n_action_steps`` and ``rtc_config`` are the lerobot folder's (copied by the export);
    ``device`` is where petite runs the programs (``"cpu"`` or ``"cuda"``); ``tokenizer``: a
    ``tokenizer.json`` for petite (else found as ``petite act`` finds it); ``python``: the
    interpreter with ExecuTorch's or ONNX Runtime's runtime, for portable and ONNX exports;
    ``seed``: petite's own noise generator; ``queue``: calls that may wait for the device."""

    chunk_size: int = 50
    n_action_steps: int = 50
    rtc_config: RTCConfig | None = None
    export_id: str | None = None
    tokenizer: str | None = None
    python: str | None = None
    seed: int | None = None
    queue: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.n_action_steps <= self.chunk_size:
            raise ValueError(
                f"n_action_steps = {self.n_action_steps}: expected 1..chunk_size ({self.chunk_size})"
            )

    def validate_features(self) -> None:
        # The features are the exported folder's, already checked by the export.
        pass

    @property
    def observation_delta_indices(self) -> None:
        return None

    @property
    def action_delta_indices(self) -> list:
        return list(range(self.chunk_size))

    @property
    def reward_delta_indices(self) -> None:
        return None

    def get_optimizer_preset(self):
        raise NotImplementedError(INFERENCE_ONLY)

    def get_scheduler_preset(self):
        raise NotImplementedError(INFERENCE_ONLY)
