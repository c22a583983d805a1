"""A robot-side real-time-chunking loop: one action per control tick from chunks requested ahead.

    import time
    import petite

    client = petite.Client("gpu-box:50051")            # petite serve --dir bundle/
    with petite.ActionLoop(client, fps=30, queue_threshold=20) as loop:
        while running:
            loop.observe(robot.get_observation())      # the latest observation, every tick
            action = loop.next_action()                # float32 [action_dim], post-processed
            if action is not None:                     # None only before the first chunk
                robot.send_action(action)
            time.sleep(...)                            # until the next tick

It is lerobot's RTC rollout (``lerobot.rollout.inference.RTCInferenceEngine`` with its
``ActionQueue``) on the robot's side of ``petite serve``: a background thread asks for the next
chunk when the queue runs low, sending the previous chunk's unexecuted rows (model space) and the
inference delay; the tick loop never waits for the policy.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Mapping, Optional, Protocol

import numpy as np
import numpy.typing as npt

__all__ = ["ActionLoop", "ChunkRecord"]


class _ChunkSource(Protocol):
    def act_chunk(self, obs: Mapping[str, Any], noise: Any = ..., seed: Optional[int] = ..., **rtc: Any) -> Any: ...


@dataclass
class ChunkRecord:
    """One chunk the loop asked for: what it sent and what came back."""

    #: Position among the loop's chunks (0 for the first).
    index: int
    #: The observation the chunk was asked for (the object given to :meth:`ActionLoop.observe`).
    observation: Mapping[str, Any]
    #: The call's seed (``None``: the policy's own noise).
    seed: Optional[int]
    #: The leftover sent (model space, ``[rows, action_dim]``), ``None`` for the first chunk.
    prev_chunk_left_over: Optional[npt.NDArray[np.float32]]
    #: The inference delay sent, in ticks: the most actions executed during any of the last
    #: ``delay_window`` requests (0 for the first).
    inference_delay: int
    #: The reply (``petite.ActionChunk``: ``actions``, ``model``, …).
    chunk: Any
    #: Seconds from the request to the reply.
    latency: float
    #: Actions executed (ticks served) while the chunk was computed: the measured inference
    #: delay. That many leading rows of the chunk are skipped, as lerobot's queue skips them.
    executed_meanwhile: int
    #: Ticks served when the request was sent.
    requested_at_tick: int = field(default=0)


class ActionLoop:
    """Real-time chunking for a robot loop over a ``petite.Client`` (or a ``petite.Policy``:
    anything with ``act_chunk(obs, noise=, seed=, prev_chunk_left_over=, inference_delay=, …)``).

    The tick loop calls :meth:`observe` with each new observation and :meth:`next_action` once a
    tick. A background thread keeps the queue: when at most ``queue_threshold`` actions are left
    (or none has come yet) it asks for a chunk for the latest observation, with
      - ``prev_chunk_left_over``: the current chunk's model-space rows not yet executed
        (``ActionChunk.model``, the same rows as the actions still queued);
      - ``inference_delay``: the actions the robot will execute meanwhile, measured: the most
        ticks served during any of the last ``delay_window`` requests;
      - ``execution_horizon``, ``prefix_attention_schedule``, ``max_guidance_weight`` when given
        (else the export's defaults).
    When the chunk comes back after ``d`` ticks served, its first ``d`` rows are dropped (the
    robot executed the old chunk's meanwhile) and the rest replaces the queue; the post-processed
    ``actions`` rows are served, the ``model`` rows of the same indices kept for the next
    leftover.

    ``fps`` is the tick rate, used only to report the delay in seconds; the delay itself is
    counted in ticks served. ``seed``: chunk ``k`` is asked with seed ``seed + k`` (reproducible
    noise), else the policy's own noise. ``history``: how many :class:`ChunkRecord` to keep in
    :attr:`chunks`.

    A failed request stops the loop: the next :meth:`next_action` raises it. Use it as a context
    manager or call :meth:`start` and :meth:`stop`.
    """

    def __init__(
        self,
        source: _ChunkSource,
        *,
        fps: float,
        queue_threshold: int,
        execution_horizon: Optional[int] = None,
        prefix_attention_schedule: Optional[str] = None,
        max_guidance_weight: Optional[float] = None,
        seed: Optional[int] = None,
        delay_window: int = 10,
        history: int = 1000,
    ) -> None:
        if fps <= 0:
            raise ValueError(f"fps: expected > 0, found {fps}")
        if queue_threshold < 0:
            raise ValueError(f"queue_threshold: expected ≥ 0, found {queue_threshold}")
        if delay_window < 1:
            raise ValueError(f"delay_window: expected ≥ 1, found {delay_window}")
        self._source = source
        self.fps = float(fps)
        self.queue_threshold = int(queue_threshold)
        self._rtc: dict[str, Any] = {}
        if execution_horizon is not None:
            self._rtc["execution_horizon"] = int(execution_horizon)
        if prefix_attention_schedule is not None:
            self._rtc["prefix_attention_schedule"] = prefix_attention_schedule
        if max_guidance_weight is not None:
            self._rtc["max_guidance_weight"] = float(max_guidance_weight)
        self._seed = seed
        self._delays: Deque[int] = deque(maxlen=delay_window)
        #: The last ``history`` chunks asked for, oldest first.
        self.chunks: Deque[ChunkRecord] = deque(maxlen=history)
        self._cond = threading.Condition()
        self._obs: Optional[Mapping[str, Any]] = None
        self._actions: Optional[np.ndarray] = None  # the current chunk's rows still to serve
        self._model: Optional[np.ndarray] = None  # their model-space rows
        self._next = 0
        self._served = 0
        self._ticks = 0
        self._empty_after_first = 0
        self._requested = 0
        self._error: Optional[BaseException] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> "ActionLoop":
        """Starts the background thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="petite-action-loop", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the background thread, waiting up to ``timeout`` seconds for a request in
        flight."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def __enter__(self) -> "ActionLoop":
        return self.start()

    def __exit__(self, *args: object) -> None:
        self.stop()

    # -- the tick loop's side ----------------------------------------------------------------

    def observe(self, obs: Mapping[str, Any]) -> None:
        """Publishes the latest observation (lerobot's keys, as ``act_chunk`` takes them); the
        next chunk is asked for the latest one published."""
        with self._cond:
            self._obs = obs
            self._cond.notify_all()

    def next_action(self) -> Optional[npt.NDArray[np.float32]]:
        """The action for this tick (post-processed, float32 ``[action_dim]``), or ``None`` when
        the queue is empty (before the first chunk; after it, a tick the policy did not keep up
        with, counted in :meth:`stats`). Raises the background thread's error if it failed."""
        with self._cond:
            if self._error is not None:
                raise RuntimeError(f"petite.ActionLoop: the chunk request failed: {self._error}") from self._error
            self._ticks += 1
            if self._actions is None or self._next >= len(self._actions):
                if self._actions is not None:
                    self._empty_after_first += 1
                return None
            a = self._actions[self._next]
            self._next += 1
            self._served += 1
            self._cond.notify_all()
            return a.copy()

    def remaining(self) -> int:
        """Actions left in the queue."""
        with self._cond:
            return 0 if self._actions is None else len(self._actions) - self._next

    def stats(self) -> dict[str, Any]:
        """Ticks, actions served, ticks without an action after the first chunk, chunks asked
        for, and the measured delays (ticks executed during each request, and seconds)."""
        with self._cond:
            recs = list(self.chunks)
            return {
                "ticks": self._ticks,
                "served": self._served,
                "empty_ticks_after_first_chunk": self._empty_after_first,
                "chunks": self._requested,
                "executed_meanwhile": [r.executed_meanwhile for r in recs],
                "inference_delay_sent": [r.inference_delay for r in recs],
                "latency_s": [r.latency for r in recs],
                "fps": self.fps,
            }

    # -- the background thread ---------------------------------------------------------------

    def _due(self) -> bool:
        if self._obs is None:
            return False
        if self._actions is None:
            return True
        return len(self._actions) - self._next <= self.queue_threshold

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with self._cond:
                    while not self._stop.is_set() and not self._due():
                        self._cond.wait(0.1)
                    if self._stop.is_set():
                        return
                    obs = self._obs
                    k = self._requested
                    self._requested += 1
                    kw: dict[str, Any] = {}
                    prev = None
                    delay = 0
                    if self._model is not None:
                        prev = self._model[self._next :].copy()
                        delay = max(self._delays, default=0)
                        if len(prev):
                            kw = dict(prev_chunk_left_over=prev, inference_delay=delay, **self._rtc)
                        else:
                            prev = None
                    served_before = self._served
                seed = None if self._seed is None else self._seed + k
                t0 = time.perf_counter()
                chunk = self._source.act_chunk(obs, seed=seed, **kw)
                latency = time.perf_counter() - t0
                actions = np.asarray(chunk.actions, dtype=np.float32)
                model = np.asarray(chunk.model, dtype=np.float32)
                if model.ndim == 3:
                    model = model[0]
                if model.shape != actions.shape:
                    raise ValueError(f"a chunk whose model rows {model.shape} do not match its actions {actions.shape}")
                with self._cond:
                    executed = self._served - served_before
                    self._delays.append(executed)
                    skip = min(executed, len(actions))
                    self._actions = actions[skip:]
                    self._model = model[skip:]
                    self._next = 0
                    self.chunks.append(ChunkRecord(
                        index=k, observation=obs, seed=seed, prev_chunk_left_over=prev,
                        inference_delay=int(kw.get("inference_delay", 0)), chunk=chunk,
                        latency=latency, executed_meanwhile=executed, requested_at_tick=served_before,
                    ))
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the tick loop
            with self._cond:
                self._error = e
                self._cond.notify_all()
