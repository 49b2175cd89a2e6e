"""Widens torchft manager_integ_test's init race (torchft_test_races.py) so that it is hit every
time: each replica sleeps inside INIT_LOCK after manual_seed(42), before its model draws its weights."""
import time

import torchft.manager_integ_test as _integ

_init = _integ.MyModel.__init__


def _after_a_pause(self, *args, **kwargs):
    time.sleep(0.3)
    _init(self, *args, **kwargs)


_integ.MyModel.__init__ = _after_a_pause
