"""Read-only public views of private attributes, declared in one line each. At the bottom of
the package: it imports nothing from dpcore."""

from __future__ import annotations

from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")


class readonly(Generic[T]):
    """``name = readonly[T]("_attr", "doc")`` in a class body: ``obj.name`` returns
    ``obj._attr`` and assigning to it raises AttributeError, as a getter-only property would."""

    def __init__(self, attr: str, doc: str = "") -> None:
        self._attr = attr
        self._name = attr
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, owner: Any = None) -> "readonly[T]": ...

    @overload
    def __get__(self, obj: object, owner: Any = None) -> T: ...

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        return getattr(obj, self._attr)

    def __set__(self, obj: Any, value: Any) -> None:
        raise AttributeError(f"{self._name} is read-only")
