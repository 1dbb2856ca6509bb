"""Sample text from a language-model checkpoint of train.py (one process).

    python generate.py checkpoint=outputs/RUN/checkpoints/best.pt prompt="def " \
        max_new_tokens=200 temperature=0.8 top_k=200 seed=0 num_samples=3

The checkpoint carries its tokenizer: no data folder is needed. The same seed gives the same
samples; a bad checkpoint, or a prompt with characters outside a char vocabulary, is one line
and exit code 2.
"""

import hydra
from omegaconf import DictConfig, OmegaConf

from ddp_utils.config import GenerateConfig
from ddp_utils.entry import clean_exit, register, user_errors
from ddp_utils.lifecycle.exit import leave

register()


@user_errors  # Hydra's composition errors: one line, exit 2
@hydra.main(version_base=None, config_path="conf", config_name="generate")
def main(cfg: DictConfig) -> None:
    with clean_exit():
        from ddp_utils.config import ConfigError

        if OmegaConf.is_missing(cfg, "checkpoint"):
            raise ConfigError(
                "checkpoint=PATH is required: python generate.py checkpoint=RUN/checkpoints/best.pt"
            )
        gen_cfg: GenerateConfig = OmegaConf.to_object(cfg)
        gen_cfg.check()
        from ddp_utils.generation import run_generate  # torch and the models only now

        run_generate(gen_cfg)


if __name__ == "__main__":
    main()
    leave()  # finished: exit without the interpreter's teardown
