"""Models (``build``): any ``_target_`` built with Hydra's ``instantiate``, sized from the
data config.

``model._target_`` names a class or function. The builder passes ``num_classes``,
``in_channels`` and ``image_size`` from the data config (token data: also ``vocab_size`` and
``block_size``), and the option's own keys (its
schema's: ``arch``, ``channels``, ``hidden``, ...), to a target whose signature takes them;
``+model.NAME=VALUE`` arguments (``model=custom``) always go to the target, which checks them.
``model.weights=PATH`` then loads a local state dict.
"""

from ddp_utils.models.build import build_model, load_weights, memory_format_of, read_state_dict

__all__ = ["build_model", "load_weights", "memory_format_of", "read_state_dict"]
