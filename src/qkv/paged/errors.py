"""What a serving loop catches from the page allocator: :class:`OutOfPages`."""

from __future__ import annotations


class OutOfPages(RuntimeError):
    """The pool has fewer free pages than a step or a reservation needs; nothing was changed.

    A ``RuntimeError``, so code that caught that before still does. A serving loop catches
    this one to wait, or to free (preempt) a running request, and try again: ``needed`` pages
    were asked for while ``free`` of the cache's ``num_pages`` were free.
    """

    def __init__(self, message: str, *, needed: int = 0, free: int = 0, num_pages: int = 0):
        super().__init__(message)
        self.needed, self.free, self.num_pages = needed, free, num_pages

    def __reduce__(self):  # pickled (a worker process's error) and copied with its counts
        return type(self), self.args, self.__dict__


def pages(n: int, more: bool = False) -> str:
    """``"1 page"``, ``"3 pages"``; with ``more``, ``"1 more page"``."""
    return f"{n} {'more ' if more else ''}page{'s' if n != 1 else ''}"
