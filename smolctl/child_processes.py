"""Worker processes that end with the command that started them.

A pool worker waits on its task queue; when the command is killed outright (`kill -9`, the OOM killer, a Slurm
job step cancelled with SIGKILL) nothing closes that queue, so the worker would wait for ever, holding its memory
(or, for stress-gpu, its GPU). Every pool initializer of smolctl calls `exit_with_parent` first.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_POLL_SECONDS = 1.0


def exit_with_parent(parent: int) -> None:
    """End this process when `parent` (the pid that started it) is gone.

    On Linux the kernel sends SIGTERM the moment the parent dies (prctl PR_SET_PDEATHSIG: it acts even while this
    process runs C code that holds the GIL); elsewhere a daemon thread looks every second."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0:
            if os.getppid() != parent:  # the parent died before the request was in place
                os._exit(1)
            return
    threading.Thread(target=_watch_parent, args=(parent,), name="watch-parent", daemon=True).start()


def leave_quietly_on_ctrl_c() -> None:
    """Ctrl-C in a terminal reaches every process of its group: a pool worker ends at once, without the traceback
    an idle worker would print (one per worker around the parent's one line); the parent says what happened and
    the units it finished are kept for a re-run. A command started with SIGINT ignored (`smolctl ... &` in a
    script) keeps its workers ignoring it too (they inherit that): one of them leaving would break the pool."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, lambda *_: os._exit(130))


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_SECONDS)
    os._exit(1)
