"""The errors that are the user's to fix, and the range checks every schema's ``check`` uses."""

from __future__ import annotations


class UserError(ValueError):
    """Something the user can fix, told in one paragraph with the fix, without a traceback: a
    diverged loss, a corrupt checkpoint, an unwritable folder, a bad image, or (``ConfigError``)
    a mistake in the configuration. An ``exit_code`` attribute chooses the script's exit code
    (2 when absent).

    ``rank_specific`` marks an error that only some ranks see, so each of them reports it.
    """

    def __init__(self, message: str, *, rank_specific: bool = False) -> None:
        super().__init__(message)
        self.rank_specific = rank_specific


class ConfigError(UserError):
    """A user's mistake in the configuration, on the command line or in an input file."""


def whole_sentences(text: str, limit: int = 240) -> str:
    """``text`` if short, else its leading whole sentences within ``limit`` (never a cut
    mid-sentence); empty when even the first sentence is longer."""
    if len(text) <= limit:
        return text
    end = text.rfind(". ", 0, limit)
    return text[: end + 1] if end > 0 else ""


def needs_target(group: str, target: str) -> ConfigError:
    """``GROUP=custom`` without its own ``_target_`` (``target``: what to give, by example):
    one message for every group."""
    return ConfigError(
        f"{group}=custom needs {group}._target_={target}; pass its arguments as "
        f"+{group}.NAME=VALUE."
    )


def check_choice(key: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(options)}; pick one of those.")


def check_positive(key: str, value: float | None, *, allow_zero: bool = False) -> None:
    """``value`` > 0 (or >= 0); None (a key switched off) passes."""
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{key}={value} is out of range: it must be {bound}.")


def check_fraction(key: str, value: float) -> None:
    """A probability-like value in [0, 1)."""
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"{key}={value} must lie in [0, 1).")
