"""The exit codes of every ``agentdispatch`` command (README, "Exit codes")."""

from __future__ import annotations

#: Done.
OK = 0
#: The command ran and was refused: bad input, an unknown job, a setting out
#: of range, a doctor check that failed.
ERROR = 1
#: A usage mistake: an unknown flag, a missing argument, a bad flag value.
USAGE = 2
#: A worker's preflight found the store or the transport unreachable: the
#: product contract gives the worker this code, so a supervisor can tell a
#: misconfigured worker (fix a setting) from one that crashed (restart it).
PREFLIGHT = 2
#: A worker stopped by an error no retry mends (its supervisor restarts it).
WORKER_FATAL = 3
#: The store or the transport cannot be reached (sysexits EX_UNAVAILABLE).
UNAVAILABLE = 69
