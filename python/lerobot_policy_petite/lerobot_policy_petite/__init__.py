"""lerobot policy type ``petite``: a pi0.5 (PI05) policy exported by ``petite export``, run by
lerobot as one of its own policies.

lerobot 0.6.1 imports this package at start-up (``register_third_party_plugins``: every
installed distribution named ``lerobot_policy_*``); importing it registers
:class:`PetiteConfig` as policy type ``petite``, and ``lerobot.policies.get_policy_class("petite")``
finds :class:`PetitePolicy` in :mod:`lerobot_policy_petite.modeling_petite` by lerobot's
``configuration_*`` → ``modeling_*`` convention.

An export of a lerobot policy folder carries lerobot's ``config.json`` (``type: petite``) and the
folder's processor files, so the usual lerobot calls work on the export directory::

    from lerobot.policies import get_policy_class, make_pre_post_processors

    policy = get_policy_class("petite").from_pretrained("my-export/")
    pre, post = make_pre_post_processors(policy.config, pretrained_path="my-export/")
    action = post(policy.select_action(pre(observation)))

or ``--policy.path=my-export/`` on lerobot's scripts.
"""

# The processors of an export are PI05's: their steps must be registered before
# `make_pre_post_processors` reads `policy_preprocessor.json`.
import lerobot.policies.pi05.processor_pi05  # noqa: F401

from .configuration_petite import PetiteConfig
from .modeling_petite import PetitePolicy

__all__ = ["PetiteConfig", "PetitePolicy"]
