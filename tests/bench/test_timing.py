"""bench.timing.StepTimes: each step's time once, in order, the newest ``keep`` held back."""

import time

from bench.timing import StepTimes


def test_step_times_come_in_order_once_and_hold_back_the_newest():
    clock = StepTimes(cuda=False)
    for pause in (0.01, 0.03, 0.02):
        time.sleep(pause)
        clock.mark()
    first = clock.ready(keep=1)
    assert len(first) == 2 and first[0] >= 0.01 and first[1] >= 0.03
    assert clock.ready(keep=1) == []
    last = clock.ready()
    assert len(last) == 1 and last[0] >= 0.02 and clock.ready() == []
