"""Comparing class lists (a folder's, a checkpoint's), in words; no image libraries needed."""

from __future__ import annotations


def class_difference(a: list[str], b: list[str], a_name: str, b_name: str) -> str:
    """How two class lists differ, in words."""
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    if not only_a and not only_b:
        return "the same names in another order"
    return f"only in {a_name}: {only_a or 'none'}; only in {b_name}: {only_b or 'none'}"
