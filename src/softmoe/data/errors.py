"""Exceptions raised by :mod:`softmoe.data`."""

from __future__ import annotations


class DatasetError(ValueError):
    """A dataset file or directory is missing, corrupt, or not in the expected format.

    The message always names the offending file (or directory) and says what is wrong: which names were
    expected, which magic number was expected and which was found, how many bytes were expected and how
    many were there, and so on.
    """


class MissingDependencyError(ImportError):
    """A loader needs an optional third-party package that is not installed."""
