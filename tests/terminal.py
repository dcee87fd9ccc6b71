"""Children that a test stops with Ctrl-C (SIGINT to their process group), started as from a terminal."""

import signal


def sigint_as_in_a_terminal() -> None:
    """``preexec_fn`` of such a child: SIGINT at its default, as for a foreground job in a terminal.

    A run started in the background of a shell script (``make test > log &``) ignores SIGINT,
    and every process it starts inherits that; a Python started with SIGINT ignored installs no
    KeyboardInterrupt handler, so the test's Ctrl-C would never reach the program under test.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)
