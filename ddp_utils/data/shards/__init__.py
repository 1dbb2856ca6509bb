"""WebDataset-layout tar shards on a folder or an object store: where they are (``store``),
their members' byte ranges (``tarindex``), what a sample's members hold (``formats``), the
``data=shards`` family that reads them (``reader``), and the writer behind
``python -m ddp_utils.shards write`` (``writer``)."""
