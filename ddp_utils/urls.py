"""Paths that may be URLs: a local folder, or any fsspec URL (``s3://bucket/prefix``,
``gs://``, ``memory://``). Data roots and checkpoint folders share these rules."""

from __future__ import annotations

from typing import Any

# fsspec's S3 options that end a request to a store that stopped answering, so that our own
# retries (not a socket's default minutes) bound the wait
S3_DEFAULTS = {"config_kwargs": {"connect_timeout": 5, "read_timeout": 20,
                                 "retries": {"max_attempts": 2}}}  # fmt: skip


def is_url(where: object) -> bool:
    """Whether ``where`` names a file system other than the local one."""
    text = str(where)
    if "://" not in text:
        return False
    return text.split("://", 1)[0] not in ("file", "local")


def local_path(where: str) -> str:
    """``file:///x`` as ``/x``; a plain path as it is."""
    text = str(where)
    for prefix in ("file://", "local://"):
        if text.startswith(prefix):
            return text[len(prefix) :]
    return text


def fs_options(url: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """fsspec's options for ``url``: the S3 defaults under the user's own."""
    import fsspec

    protocol = fsspec.utils.get_protocol(url)
    return {**(S3_DEFAULTS if protocol in ("s3", "s3a") else {}), **storage_options}
