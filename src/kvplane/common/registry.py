"""A lazy, explicit registry: short name -> "module:Class", imported only when chosen."""

from __future__ import annotations

import importlib
from typing import Generic, TypeVar

from kvplane.common.errors import Conflict, InvalidArgument

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to import paths. Duplicate names raise; unknown names list the choices.

    Args:
        kind: what is registered (used in error messages), e.g. ``"transport"``.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._paths: dict[str, str] = {}

    def register(self, name: str, path: str) -> None:
        """Register ``name`` -> ``"package.module:Class"``.

        Raises:
            Conflict: if the name is already registered.
        """
        if name in self._paths:
            raise Conflict(f"{self.kind} {name!r} already registered as {self._paths[name]}")
        self._paths[name] = path

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._paths)

    def load(self, name: str) -> type[T]:
        """Import and return the class for ``name`` (or an explicit ``module:Class`` string).

        Raises:
            InvalidArgument: for an unknown name. Import errors propagate: a broken plugin fails loudly.
        """
        path = self._paths.get(name)
        if path is None:
            if ":" not in name:
                raise InvalidArgument(f"unknown {self.kind} {name!r}; choose one of {self.names()}")
            path = name
        module, _, attr = path.partition(":")
        return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]  # the factory the registry names
