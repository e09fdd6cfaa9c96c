"""Two threads whose guards overlap, for the tests of process-wide guards (a sync guard's debug mode)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager


def first_leaves_while_second_is_inside(guard: Callable[[], AbstractContextManager], inside: Callable[[], object],
                                        timeout: float = 10.0):
    """Two threads each enter ``guard()``: the first, then the second; the first leaves while the second is still
    inside, and then the second thread calls ``inside()``, whose value this returns once both threads have left. The
    first exception either thread raised is raised here; ``TimeoutError`` when a step did not happen within
    ``timeout`` seconds (a guard that lets one thread in at a time: the threads never overlapped)."""
    first_in, second_in, first_out = (threading.Event() for _ in range(3))
    seen, errors = [], []

    def waited(event: threading.Event, what: str) -> None:
        if not event.wait(timeout):
            raise TimeoutError(f"{what} within {timeout} s")

    def first():
        try:
            with guard():
                first_in.set()
                waited(second_in, "the second thread did not enter its guard while the first was inside it")
        except BaseException as exc:  # noqa: BLE001 (raised again by the calling thread)
            errors.append(exc)
        finally:
            first_out.set()

    def second():
        try:
            waited(first_in, "the first thread did not enter its guard")
            with guard():
                second_in.set()
                waited(first_out, "the first thread did not leave its guard while the second was inside it")
                seen.append(inside())
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    if errors:
        raise errors[0]
    if not seen:
        raise TimeoutError(f"the two threads did not finish within {timeout} s")
    return seen[0]
