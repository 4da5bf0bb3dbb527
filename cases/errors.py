"""The one error type for malformed case specifications.

Every validation failure names the offending field (a dotted path such as ``layout.cu_seqlens_padded``) so that a
user who hand-edits a case JSON sees what is wrong, never a traceback from inside torch.
"""


class CaseError(ValueError):
    """A case, config or layout that cannot be run. ``field`` is the dotted path of the bad field."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


def require(condition: bool, field: str, message: str) -> None:
    """Raise :class:`CaseError` for ``field`` unless ``condition`` holds."""
    if not condition:
        raise CaseError(field, message)
