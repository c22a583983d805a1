from os import PathLike
from typing import Any, Mapping, Optional, Union

import numpy as np
import numpy.typing as npt

__version__: str

class Busy(RuntimeError): ...

class ActionChunk:
    @property
    def actions(self) -> npt.NDArray[np.float32]: ...
    @property
    def model(self) -> npt.NDArray[np.float32]: ...
    @property
    def chunk(self) -> int: ...
    @property
    def action_dim(self) -> int: ...
    @property
    def n_action_steps(self) -> int: ...
    @property
    def prompt(self) -> str: ...
    @property
    def tokens(self) -> npt.NDArray[np.int64]: ...
    @property
    def token_mask(self) -> npt.NDArray[np.bool_]: ...
    @property
    def seconds(self) -> float: ...
    @property
    def server_ms(self) -> Optional[float]: ...

_Path = Union[str, PathLike]
_Obs = Mapping[str, Any]

class Policy:
    def __init__(
        self,
        export_dir: _Path,
        device: str = "cpu",
        tokenizer: Optional[_Path] = None,
        python: Optional[_Path] = None,
        seed: Optional[int] = None,
        queue: int = 8,
    ) -> None: ...
    @property
    def info(self) -> dict[str, Any]: ...
    def act(
        self, obs: _Obs, noise: Optional[npt.ArrayLike] = None, seed: Optional[int] = None, wait: bool = True,
        prev_chunk_left_over: Optional[npt.ArrayLike] = None,
        inference_delay: Optional[int] = None,
        execution_horizon: Optional[int] = None,
        prefix_attention_schedule: Optional[Any] = None,
        max_guidance_weight: Optional[float] = None,
    ) -> npt.NDArray[np.float32]: ...
    def predict_action_chunk(
        self, obs: _Obs, noise: Optional[npt.ArrayLike] = None, seed: Optional[int] = None, wait: bool = True,
        prev_chunk_left_over: Optional[npt.ArrayLike] = None,
        inference_delay: Optional[int] = None,
        execution_horizon: Optional[int] = None,
        prefix_attention_schedule: Optional[Any] = None,
        max_guidance_weight: Optional[float] = None,
    ) -> npt.NDArray[np.float32]: ...
    def act_chunk(
        self, obs: _Obs, noise: Optional[npt.ArrayLike] = None, seed: Optional[int] = None, wait: bool = True,
        prev_chunk_left_over: Optional[npt.ArrayLike] = None,
        inference_delay: Optional[int] = None,
        execution_horizon: Optional[int] = None,
        prefix_attention_schedule: Optional[Any] = None,
        max_guidance_weight: Optional[float] = None,
    ) -> ActionChunk: ...
    def predict_action_chunk_model(
        self, batch: _Obs, noise: Optional[npt.ArrayLike] = None, seed: Optional[int] = None, wait: bool = True,
        prev_chunk_left_over: Optional[npt.ArrayLike] = None,
        inference_delay: Optional[int] = None,
        execution_horizon: Optional[int] = None,
        prefix_attention_schedule: Optional[Any] = None,
        max_guidance_weight: Optional[float] = None,
    ) -> npt.NDArray[np.float32]: ...
    def close(self) -> None: ...
    def __enter__(self) -> "Policy": ...
    def __exit__(self, *args: object) -> None: ...

class Client:
    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        timeout: Optional[float] = None,
        connect_timeout: float = 5.0,
    ) -> None: ...
    @property
    def info(self) -> dict[str, Any]: ...
    def healthy(self) -> bool: ...
    def act(
        self, obs: _Obs, noise: Optional[npt.ArrayLike] = None, seed: Optional[int] = None,
        prev_chunk_left_over: Optional[npt.ArrayLike] = None,
        inference_delay: Optional[int] = None,
        execution_horizon: Optional[int] = None,
        prefix_attention_schedule: Optional[Any] = None,
        max_guidance_weight: Optional[float] = None,
    ) -> npt.NDArray[np.float32]: ...
    def predict_action_chunk(
        self, obs: _Obs, noise: Optional[npt.ArrayLike] = None, seed: Optional[int] = None,
        prev_chunk_left_over: Optional[npt.ArrayLike] = None,
        inference_delay: Optional[int] = None,
        execution_horizon: Optional[int] = None,
        prefix_attention_schedule: Optional[Any] = None,
        max_guidance_weight: Optional[float] = None,
    ) -> npt.NDArray[np.float32]: ...
    def act_chunk(
        self, obs: _Obs, noise: Optional[npt.ArrayLike] = None, seed: Optional[int] = None,
        prev_chunk_left_over: Optional[npt.ArrayLike] = None,
        inference_delay: Optional[int] = None,
        execution_horizon: Optional[int] = None,
        prefix_attention_schedule: Optional[Any] = None,
        max_guidance_weight: Optional[float] = None,
    ) -> ActionChunk: ...
    def __enter__(self) -> "Client": ...
    def __exit__(self, *args: object) -> None: ...
