"""The two ways a command ends early: the user's input is wrong (exit 2) or a check failed (exit 1)."""


class UserError(Exception):
    """Bad input or usage. Rendered as one line, `error: <where>: <what> — <what to do>`, exit code 2."""

    exit_code = 2

    def __init__(self, where: str, what: str, fix: str | None = None):
        self.where, self.what, self.fix = str(where), what, fix
        super().__init__(self.line())

    def line(self) -> str:
        text = f"{self.where}: {self.what}" if self.where else self.what
        return f"{text} — {self.fix}" if self.fix else text


class CheckFailed(Exception):
    """A check that ran and failed (a checksum, a bandwidth target, a faulty GPU): exit code 1."""

    exit_code = 1


class Interrupted(Exception):
    """Ctrl-C during a long command: one line saying what was kept and how to continue, exit code 130."""

    exit_code = 130
