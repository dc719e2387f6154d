"""How the scripts under scripts/ end: a user's mistake in one line, as the command line does.

A mistyped option value (an unknown policy or workload, a bad ``--set key=value``, a missing
file) raises ValueError (ConfigError and InvalidRequestError are ValueErrors) or
FileNotFoundError, and a policy of one's own that stalls the simulator raises PolicyStalledError
(its message names the policy and the requests it held); ``run_main`` prints it as
``<script>: error: <message>`` and exits 2 instead of showing a traceback. Anything else still
raises with its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

USER_ERRORS = (ValueError, FileNotFoundError)


def run_main(main: Callable[[], object]) -> NoReturn:
    """Run a script's ``main`` and exit with its status (an int, else 0)."""
    try:
        status = main()
    except USER_ERRORS as exc:
        _exit_with(exc)
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except Exception as exc:
        # imported only here: the scheduler's modules would add ~0.3 s to every script's start
        from asyncengine.scheduler.policy_guard import PolicyStalledError

        if isinstance(exc, PolicyStalledError):
            _exit_with(exc)
        raise
    raise SystemExit(status if isinstance(status, int) else 0)


def _exit_with(exc: BaseException) -> NoReturn:
    print(f"{Path(sys.argv[0]).name}: error: {exc}", file=sys.stderr)
    raise SystemExit(2) from None
