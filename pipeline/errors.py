"""The one base of every refusal: `UserError` is a bad input, config or environment the user can fix.

Its message names the file, the field or value, and the fix (docs/bad-inputs.md). `command` below, the one handler
(every entry's `main` wears it), prints `gkd COMMAND: MESSAGE` with exit status 2 and no traceback (`--verbose` adds
it); any other exception is a bug and keeps its traceback. Each refusal class keeps its older base too (ValueError,
RuntimeError, FileNotFoundError), so code that catches those still does.
"""

from __future__ import annotations

import functools
import sys
import traceback
import typing
from collections.abc import Callable

from pipeline import lifetime, logs

Main = Callable[[list[str] | None], int]


class UserError(Exception):
    """A refusal: the message says what is wrong, where, and how to fix it."""


class MissingInputError(UserError, FileNotFoundError):
    """A file or folder the command needs is not there; the message names it and what writes it."""


class InputError(UserError, ValueError):
    """An input that cannot be used as given (and no more specific class fits); the message names it and the fix."""


def command(prog: str) -> Callable[[Main], Main]:
    """Decorate an entry's `main(argv) -> int`: a refusal prints `PROG: MESSAGE` on stderr and returns 2.

    The one place a refusal becomes a message, for `gkd` (pipeline/cli.py) and for every entry run on its own
    (`torchrun -m pipeline.train.run`, tests calling a stage's `main`). A missing file the OS names
    (FileNotFoundError) counts as a refusal too, as every stage treated it before; any other exception is a bug and
    keeps its traceback. With `--verbose` the refusal's traceback is printed as well. It also marks the process
    as a command whose children die with it (pipeline/lifetime.py).
    """

    def wrap(main: Main) -> Main:
        @functools.wraps(main)
        def run(argv: list[str] | None = None) -> int:
            lifetime.mark_command()  # what this command starts dies with it (pipeline/lifetime.py)
            try:
                return main(argv)
            except (UserError, FileNotFoundError) as e:
                if logs.verbose():
                    traceback.print_exc()
                print(f"{prog}: {e}", file=sys.stderr)
                return 2

        return typing.cast(Main, run)

    return wrap
