"""ml_dtypes (BF16 and FP8 numpy dtypes), imported on first use: it takes a large share of
`import pagedkv` and of every command line start, and most calls never need it.

`ml()` is the module; `DtypeTable(eager, lazy)` is a read-only-in-spirit dict of dtype names
whose `lazy` entries (name -> attribute of ml_dtypes) are made the first time they are
looked up or tested with `in`.
"""

from __future__ import annotations

import importlib

import numpy as np

_MODULE: list = []


def ml():
    """The ml_dtypes module (imported once, on the first call)."""
    if not _MODULE:
        _MODULE.append(importlib.import_module("ml_dtypes"))
    return _MODULE[0]


class DtypeTable(dict):
    """name -> np.dtype; the `lazy` names resolve through ml_dtypes on first lookup."""

    def __init__(self, eager: dict, lazy: dict):
        super().__init__(eager)
        self._lazy = dict(lazy)

    def __missing__(self, name):
        attribute = self._lazy.get(name)
        if attribute is None:
            raise KeyError(name)
        dtype = self[name] = np.dtype(getattr(ml(), attribute))
        return dtype

    def __contains__(self, name) -> bool:
        return dict.__contains__(self, name) or name in self._lazy

    def names(self) -> list[str]:
        """Every name the table holds, those not yet resolved included."""
        return list(dict.keys(self)) + [n for n in self._lazy if not dict.__contains__(self, n)]

    def get(self, name, default=None):
        """`self[name]`, or `default` for a name it does not hold."""
        return self[name] if name in self else default
