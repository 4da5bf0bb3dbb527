"""The one error type of the report layer: a results stream, baseline or option that cannot be rendered.

``where`` names the place (``results.jsonl:17 field 'case_id'``, ``--baseline``, ``baselines/cpu/smoke``) so the CLI
prints one line a user can act on instead of a traceback.
"""


class ReportError(ValueError):
    """Bad report input. ``where`` is the file:line / field / option at fault."""

    def __init__(self, where: str, message: str):
        self.where = where
        self.message = message
        super().__init__(f"{where}: {message}")
