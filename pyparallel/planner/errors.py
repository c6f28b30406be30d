"""The planner's one exception type."""


class PlanError(ValueError):
    """Bad planner input, or a configuration that fits nowhere.

    The message names the offending numbers and says what to change; ``pyparallel plan`` prints it on
    one line and exits with status 2 (no traceback), as DESIGN.md principle 6 asks.
    """
