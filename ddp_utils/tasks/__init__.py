"""Tasks: the training objective behind ``task=...``; ``build_task`` is the front door.

``task=classification`` (the default) is cross-entropy with torchmetrics' classification
metrics; ``task=custom task._target_=pkg.module.MyTask +task.NAME=VALUE`` builds your own
``Task`` subclass (``ddp_utils.tasks.base``) with Hydra's ``instantiate``. One module per
task (``classification``, ``segmentation``, ``detection``, ``language_model``); ``build``
builds and checks one.
"""

from ddp_utils.tasks.base import Batch, Task
from ddp_utils.tasks.build import blank_batch, build_task, check_task, draw_predictions

__all__ = ["Batch", "Task", "blank_batch", "build_task", "check_task", "draw_predictions"]
