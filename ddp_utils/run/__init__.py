"""A run's folder: where it is, its lock and run.json (``folder``), and its metrics.jsonl
(``records``)."""
