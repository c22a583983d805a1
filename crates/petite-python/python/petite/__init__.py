"""petite: an exported pi0.5 policy (lerobot's PI05), opened once and run in a loop.

    import numpy as np
    import petite

    policy = petite.Policy("bundle/", device="cpu")      # what `petite export` wrote
    obs = {
        "observation.images.image": np.zeros((224, 224, 3), np.uint8),  # HWC uint8 or CHW float
        "observation.state": np.zeros(policy.info["state_dim"], np.float32),
        "task": "pick up the cube",
    }
    actions = policy.act(obs)                   # float32 [chunk, action_dim], post-processed
    model = policy.predict_action_chunk(obs)    # float32 [1, chunk, action_dim], model space

A policy served by `petite serve` (on this machine or another) is called the same way:

    client = petite.Client("127.0.0.1:50051")   # petite serve --dir bundle/
    actions = client.act(obs)

A robot loop over a served policy with real-time chunking (lerobot's RTC: the next chunk asked for
in the background, guided by the unexecuted rest of the current one):

    with petite.ActionLoop(client, fps=30, queue_threshold=20) as loop:
        loop.observe(obs)            # every tick
        action = loop.next_action()  # float32 [action_dim], or None before the first chunk

The observation's keys are lerobot's; other keys are skipped. One policy may be shared by
threads: chunks run one at a time in arrival order, with the GIL released meanwhile. A bad
observation raises ValueError naming the key; `wait=False` raises `petite.Busy` when the
policy's queue is full; anything else is a RuntimeError. A Client also raises
ConnectionError when the server cannot be reached, TimeoutError past its `timeout`, and
`petite.Busy` when the server's queue is full.
"""

from ._petite import ActionChunk, Busy, Client, Policy, __version__
from .loop import ActionLoop, ChunkRecord

__all__ = ["ActionChunk", "ActionLoop", "Busy", "ChunkRecord", "Client", "Policy", "__version__"]
