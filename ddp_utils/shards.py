"""``python -m ddp_utils.shards write ...``: the shard writer's command (its code is
ddp_utils/data/shards/writer.py)."""

if __name__ == "__main__":
    from ddp_utils.data.shards.writer import main

    raise SystemExit(main())
