"""Edits of a compiled kernel's queue for the tests that show a barrier wait is needed."""

import contextlib
import dataclasses


@contextlib.contextmanager
def without_waits(kernel, kind: str):
    """``kernel``'s queue with every ``kind`` entry's barrier waits dropped, restored on exit."""
    q0 = kernel.queue
    kernel.queue = dataclasses.replace(q0, entries=tuple(dataclasses.replace(e, waits=()) if e.op.kind == kind else e
                                                         for e in q0.entries))
    try:
        yield kernel
    finally:
        kernel.queue = q0
