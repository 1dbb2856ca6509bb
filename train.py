"""Train a model with DistributedDataParallel.

One process (world size 1):
    python train.py
One node, 8 processes:
    torchrun --standalone --nproc_per_node=8 train.py optim.lr=0.1 data=mnist
Semantic segmentation (the embedded recipe; or data=segfolder data.root=DIR, data=voc):
    torchrun --standalone --nproc_per_node=2 train.py experiment=digits_segmentation
A sweep, every job on all ranks (or each job as its own torchrun job):
    torchrun --standalone --nproc_per_node=2 train.py -m optim.lr=0.1,0.01
    python train.py -m hydra/launcher=torchrun hydra.launcher.nproc_per_node=2 optim.lr=0.1,0.01
An Optuna search (hydra/sweeper=optuna), every rank on rank 0's trial:
    torchrun --standalone --nproc_per_node=2 train.py -m +hparams_search=digits_optuna
Many nodes (run on each; docs/multinode.md):
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=4 --nproc_per_node=8 \
        --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT --rdzv-id=JOB train.py
"""

import hydra
from omegaconf import DictConfig
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_utils.config import to_schema
from ddp_utils.dist import init_distributed
from ddp_utils.entry import clean_exit, register, user_errors
from ddp_utils.lifecycle.exit import leave
from ddp_utils.lifecycle.peers import process_group_left
from ddp_utils.sweep import in_sweep, sweep_job_dir

register()


@user_errors  # Hydra's composition errors: one line from rank 0, exit 2
@hydra.main(version_base=None, config_path="conf", config_name="train")
@record  # torchrun then reports the failing rank's traceback
def main(cfg: DictConfig) -> float:
    # A sweep's jobs share the process group: only a single run leaves it at its end.
    with clean_exit(), process_group_left(not in_sweep()):
        train_cfg = to_schema(cfg)
        # Imported only now: --help, --cfg and config mistakes answer without loading the
        # models, data and metrics libraries (seconds less for every such launch).
        from ddp_utils.sweep.pruning import sweep_callbacks
        from ddp_utils.train.loop import fit

        rt = init_distributed(train_cfg.trainer)
        return fit(train_cfg, rt, sweep_job_dir(), sweep_callbacks())


if __name__ == "__main__":
    main()
    leave()  # finished: exit without the interpreter's teardown
