"""The engine's undo log: a change to its state happens completely or not at all.

Every operation on the engine (a step, queueing requests, an abort, a cache reset) runs inside
``journal.transaction()``. Before a part of the engine changes an object, it calls
``journal.keep(obj)``; the first call in a transaction saves the object's fields (lists,
deques and dicts among them by content). If anything raises before the transaction ends -- a
failing hook, a ``MemoryError``, a ``KeyboardInterrupt`` between any two lines -- every kept
object is put back as it was, and the exception goes on. The one large map, the prefix cache's
hash -> block, is kept key by key (``keep_key``) instead of whole.

Outside a transaction ``keep`` does nothing, so the parts work on their own as before (the
teaching tools drive a scheduler and a prefix cache without an engine). The KV pool's tensors
are not kept: a failed step may have written K/V only into slots of tokens it had not
computed before, which the retried step writes again.
"""
from __future__ import annotations

import contextlib
from collections import deque
from typing import Iterator

MISSING = object()  # a dict key that was absent


class Journal:
    def __init__(self) -> None:
        self._saved: dict[int, tuple] | None = None  # id(obj) -> (obj, its fields); None: closed
        self._keys: list[tuple] = []                 # (dict, key, old value or MISSING)

    @property
    def open(self) -> bool:
        return self._saved is not None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Roll back everything kept if the block raises. It always starts afresh: if the end of
        the last one was itself interrupted, what that one kept is simply dropped (it had
        finished). Nesting is the caller's to avoid (the engine core opens only outer ones)."""
        log = None  # this transaction's own: an interrupt before it exists rolls nothing back
        try:
            log = self._begin()
            yield
        except BaseException:
            if log is not None:
                _rollback(*log)
            raise
        finally:
            self._saved, self._keys = None, []

    def _begin(self) -> tuple[dict, list]:
        self._saved, self._keys = log = {}, []
        return log

    def keep(self, *objects) -> None:
        """Save each object's fields, once per transaction, before it is changed."""
        if self._saved is None:
            return
        for obj in objects:
            if obj is not None and id(obj) not in self._saved:
                self._saved[id(obj)] = (obj, _fields_of(obj))

    def keep_key(self, mapping: dict, key) -> None:
        """Save one entry of ``mapping`` (or its absence) before it is set or deleted."""
        if self._saved is not None:
            self._keys.append((mapping, key, mapping.get(key, MISSING)))

def _rollback(saved: dict, keys: list) -> None:
    """Put every kept entry and object back: entries newest first, then each object's fields."""
    for mapping, key, old in reversed(keys):
        if old is MISSING:
            dict.pop(mapping, key, None)
        else:
            dict.__setitem__(mapping, key, old)
    for obj, fields in saved.values():
        for name, (value, contents) in fields.items():
            setattr(obj, name, value)
            if contents is not None:
                _refill(value, contents)


def _fields_of(obj) -> dict:
    """name -> (value, a copy of its contents when it is a list, deque, dict or set)."""
    skip = getattr(obj, "_journal_skip", ())
    names = [n for n in _field_names(obj) if n not in skip]
    return {name: _saved_value(getattr(obj, name)) for name in names}


def _field_names(obj) -> list[str]:
    if hasattr(obj, "__dict__"):
        return list(vars(obj))
    return [name for cls in type(obj).__mro__ for name in getattr(cls, "__slots__", ())]


def _saved_value(value) -> tuple:
    if isinstance(value, JournaledDict):
        return value, None  # its entries keep themselves
    if isinstance(value, (list, deque, set)):
        return value, list(value)
    if isinstance(value, dict):
        return value, dict(value)
    return value, None


def _refill(container, contents) -> None:
    """Put ``contents`` back into the same container object (others may hold it)."""
    container.clear()
    if isinstance(container, dict):
        dict.update(container, contents)
    elif isinstance(container, set):
        container.update(contents)
    else:
        container.extend(contents)


class JournaledDict(dict):
    """A dict whose every change is kept, entry by entry, in ``journal`` (reads are a dict's)."""

    def __init__(self, journal: Journal, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.journal = journal

    def __setitem__(self, key, value) -> None:
        self.journal.keep_key(self, key)
        super().__setitem__(key, value)

    def __delitem__(self, key) -> None:
        self.journal.keep_key(self, key)
        super().__delitem__(key)

    def pop(self, key, *default):
        self.journal.keep_key(self, key)
        return super().pop(key, *default)

    def setdefault(self, key, default=None):
        self.journal.keep_key(self, key)
        return super().setdefault(key, default)

    def update(self, *args, **kwargs) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def clear(self) -> None:
        for key in list(self):
            del self[key]

    def popitem(self):
        key = next(reversed(self))
        return key, self.pop(key)
