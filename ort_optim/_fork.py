"""Locks that a child of os.fork gets anew.

os.fork (multiprocessing's "fork" start method) copies the process with only the thread that calls it: a lock that
another thread of the parent holds at that moment stays held in the child, by a thread that never runs there, and the
child's first use of it waits forever. CPython makes its own modules' locks anew in a forked child; ort_optim's
locks, each made by :func:`renewed_lock`, are made anew there likewise (os.register_at_fork); ort_optim.options,
which loads without the rest of the package, renews its own.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Callable

# Every owner of such a lock alive in this process (a module, an optimizer; held weakly: it keeps none alive), with
# the attribute that holds each of its locks and the function that makes it.
_OWNERS: "weakref.WeakKeyDictionary[Any, dict[str, Callable[[], Any]]]" = weakref.WeakKeyDictionary()


def renewed_lock(owner: Any, name: str, make: Callable[[], Any] = threading.Lock) -> Any:
    """A new lock, ``make()``, for the caller to keep as ``owner.<name>`` (an object's attribute, or a global of the
    module ``owner``): in a child of os.fork, ``owner.<name>`` is then a new, unheld one. What a thread of the parent
    does under the lock never ends in the child; a ``with`` block that the forking thread itself is in releases the
    lock it acquired."""
    _OWNERS.setdefault(owner, {})[name] = make
    return make()


def _renew_locks() -> None:
    for owner, locks in list(_OWNERS.items()):
        for name, make in locks.items():
            setattr(owner, name, make())


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_locks)
