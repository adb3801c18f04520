"""Step functions for the batcher's tests that record what each launch carried."""

from __future__ import annotations


def counting_carried(step, carried: list[int]):
    """``step``, appending to ``carried`` each launch's rows whose token it reads on the device (the launch
    before's: it was queued ahead, ``Batcher(run_ahead=True)``)."""
    def wrapped(rows):
        carried.append(rows.host_token.count(-1))
        return step(rows)
    return wrapped
