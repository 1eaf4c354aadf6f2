"""The Engine's one-thread rule, checked: its `@entry_point` methods assert that they run
on its owner thread.

The Engine holds no lock: its scheduler, page pool and requests are changed by whoever
calls in, so two threads calling in race. The owner is `AsyncEngine`'s thread once that
has started (it binds the Engine there, and unbinds it when its loop ends); an unbound
Engine (synchronous use, as `LLM`) belongs to the first thread that enters it. A call from
any other thread raises AssertionError naming both threads, at the call, instead of
corrupting a step.

A debug check: the methods are wrapped only while `__debug__` (Python without -O, so in
`make test`, the servers its tests start, and by default everywhere), and the wrapper
costs one thread-id compare per call. Left unchecked: what reads constants
(`num_total_pages`) and what step itself calls once per output (`output_of`).
"""

from __future__ import annotations

import functools
import threading


class SingleThreaded:
    """Base of an object that one thread owns at a time (see the module docstring)."""

    _owner_ident: int | None = None  # None: the next thread to enter becomes the owner
    _owner_name = ""

    def bind_to_current_thread(self) -> None:
        """The calling thread becomes the owner (an AsyncEngine takes its Engine over)."""
        thread = threading.current_thread()
        self._owner_ident, self._owner_name = thread.ident, thread.name

    def unbind_thread(self) -> None:
        """No owner until the next thread enters (the owner thread is ending)."""
        self._owner_ident = None

    def _enter_elsewhere(self, method: str) -> None:
        if self._owner_ident is None:
            self.bind_to_current_thread()
            return
        raise AssertionError(
            f"{type(self).__name__}.{method} called on thread {threading.current_thread().name!r}, "
            f"but thread {self._owner_name!r} owns it: from another thread, go through "
            "AsyncEngine (`run`), which calls it on the engine thread")


def entry_point(method):
    """`method` asserts that it runs on its object's owner thread."""
    if not __debug__:
        return method

    @functools.wraps(method)
    def checked(self, *args, **kwargs):
        if self._owner_ident != threading.get_ident():
            self._enter_elsewhere(method.__name__)
        return method(self, *args, **kwargs)
    return checked
