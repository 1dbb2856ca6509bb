"""What the tests share: ``paths``, ``launch`` (scripts and ranks), ``runs`` (what a run
left), ``faults``. Fixtures are in tests/conftest.py."""
