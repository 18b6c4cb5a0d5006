"""How many CPU threads torch trains with when the user does not say.

torch's own default is one thread per core. Its threads meet at a barrier
after every operation, so when another process holds one of the cores, every
operation waits for the thread that is descheduled, while one thread is
never held at a barrier (`benchmarks/threads.py` measures both, idle and
under a load it makes itself: benchmarks/RESULTS.md, "Torch threads on a busy
CPU"). So the default counts the cores that are free now: the cores this
process may run on, less the 1-minute load average (the processes already
running or waiting for a core), at least one, at most torch's default. A
machine that is idle gets every core; a busy one gets what is left, down to
one thread, which cannot be slowed by a barrier.

`OMP_NUM_THREADS` (or an explicit `--threads`) overrides the rule:
`accelerate launch` / torchrun set it to 1 for several processes per machine.
"""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def load_average() -> float:
    """The 1-minute load average; 0 where the OS has none (Windows)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def free_cores() -> int:
    """Usable cores less the ones the load average says are taken, at least one."""
    return max(1, usable_cores() - round(load_average()))


def set_cpu_threads(requested: int | None = None) -> tuple[int, str]:
    """Set torch's intra-op threads: `requested`, else `OMP_NUM_THREADS`'s, else `free_cores()` (capped by
    torch's default). Returns the count and why (for the log)."""
    import torch

    if requested:
        reason = "--threads"
    elif os.environ.get("OMP_NUM_THREADS"):
        requested, reason = torch.get_num_threads(), "OMP_NUM_THREADS"
    else:
        requested = min(torch.get_num_threads(), free_cores())
        reason = f"free cores: {usable_cores()} usable, load average {load_average():.1f}"
    torch.set_num_threads(requested)
    return requested, reason
