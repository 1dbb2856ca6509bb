"""Evaluate a train.py checkpoint exactly: the same numbers at any world size.

One process:
    python eval.py checkpoint=outputs/RUN/checkpoints/best.pt
One node, N processes (any N):
    torchrun --standalone --nproc_per_node=3 eval.py checkpoint=outputs/RUN/checkpoints/best.pt
Override any key of the checkpoint's config:
    python eval.py checkpoint=PATH data.root=/data data.split=train output=x.json
"""

import hydra
from omegaconf import DictConfig
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_utils.entry import (
    clean_exit,
    implied_options,
    register,
    user_errors,
    with_checkpoint_options,
)
from ddp_utils.lifecycle.exit import leave
from ddp_utils.lifecycle.peers import process_group_left

register()


@user_errors  # Hydra's composition errors: one line from rank 0, exit 2
@with_checkpoint_options  # the checkpoint's data, model and task options, to override keys of
@hydra.main(version_base=None, config_path="conf", config_name="eval")
@record  # torchrun then reports the failing rank's traceback
def main(cfg: DictConfig) -> float:
    from ddp_utils.eval_checkpoint import run_eval  # here: --help and mistakes answer sooner

    with clean_exit(), process_group_left():
        result = run_eval(cfg, implied_options())
        return result.get(result["monitor"], float("nan"))


if __name__ == "__main__":
    main()
    leave()  # finished: exit without the interpreter's teardown
