"""``python -m runtime.cluster.serve [runtime.launch options]``: ``runtime.launch`` that stops with its parent.

A Ray actor (``runtime.cluster.ray_fleet.ServerActor``) starts this with a pipe as stdin and
keeps the write end. When the actor's process ends, however it ends (``ray.kill``, a crash,
SIGKILL), the pipe reads EOF and this process SIGTERMs itself: the server drains for
``--drain-timeout-s`` and exits as after Ctrl-C, its ranks and segments with it.

    actor process ---- stdin pipe (held open, never written) ----> this process
      exits: EOF  ------------------------------------------------> thread: SIGTERM to itself
                                                                    runtime.launch.main: drain, exit 0
"""

from __future__ import annotations

import os
import signal
import sys
import threading


def _stop_at_eof() -> None:
    """Block until stdin closes (the parent is gone), then ask this process to stop.

    Reads the descriptor itself, not ``sys.stdin``: a daemon thread blocked inside a buffered
    reader's lock makes the interpreter abort at exit."""
    try:
        while os.read(0, 4096):
            pass
    except OSError:  # stdin is no pipe at all: stop as if it closed
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    threading.Thread(target=_stop_at_eof, name="phyrt-parent-pipe", daemon=True).start()
    from runtime.launch import main as launch

    return launch(argv)


if __name__ == "__main__":
    sys.exit(main())
