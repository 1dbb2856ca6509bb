"""The tar-shard options' store keys (``ShardStore``) and ``data=shards``; their reader
and writer are ddp_utils/data/shards/."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ddp_utils.config.data.base import DataConfig
from ddp_utils.config.data.images import StreamedData
from ddp_utils.config.errors import (
    check_positive,
)


@dataclass
class ShardStore(DataConfig):
    """Where tar shards are and how they are read: the keys data=shards, segshards and
    detshards share (``ddp_utils.data.shards``)."""

    root: str = "shards"  # a folder or URL holding <train_dir>/ and <val_dir>/
    # A split's folder (its *.tar), or a brace pattern of shards: train/s-{000..099}.tar
    train_dir: str = "train"
    val_dir: str = "val"
    # fsspec's options for the store (s3fs: endpoint_url, key, secret, client_kwargs, ...);
    # S3 also reads AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ... and its usual credential chain
    storage_options: dict[str, Any] = field(default_factory=dict)
    # Where remote shards are kept on this node (null: ~/.cache/ddp-recipes/shards), and how
    # many bytes they may take (least recently used go first); 0 reads by range requests
    cache_dir: str | None = None
    cache_bytes: int = 50 * 2**30
    # The epoch's order: the shards shuffled, then the samples within each window of this
    # many shards (from seed and epoch alone); 1 reads one shard at a time
    shuffle_window: int = 8
    retries: int = 5  # attempts at a shard before the store counts as gone (backoff 1, 2, 4 s...)

    def check(self) -> None:
        super().check()
        check_positive("data.shuffle_window", self.shuffle_window)
        check_positive("data.cache_bytes", self.cache_bytes, allow_zero=True)
        check_positive("data.retries", self.retries)


@dataclass
class ShardsData(StreamedData, ShardStore):
    """data=shards: WebDataset-layout tar shards (KEY.<image> + KEY.cls) under
    data.root/<train_dir>/*.tar (and <val_dir>), in a local folder or at any fsspec URL."""

    family: ClassVar[str] = "ddp_utils.data.shards.reader"
    name: str = "shards"
