"""Put this directory first on PYTHONPATH to run a process whose wall clock is
off by ``AGENTDISPATCH_TEST_SKEW_S`` seconds, as on a host with a wrong clock
(the monotonic clock is untouched, as it is there)."""

import os
import time

_skew = float(os.environ.get("AGENTDISPATCH_TEST_SKEW_S") or 0)
if _skew:
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _skew
    time.time_ns = lambda: _time_ns() + int(_skew * 1e9)
