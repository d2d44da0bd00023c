"""The one exception type of the ops layer, carrying the aclnn status code of the matching NPU failure."""

from __future__ import annotations

ACLNN_ERR_PARAM_NULLPTR = 161001
"""A required tensor or argument is missing (``None``)."""
ACLNN_ERR_PARAM_INVALID = 161002
"""A dtype or a parameter value is not supported."""
ACLNN_ERR_INNER_TILING_ERROR = 561002
"""A shape, or a value derived from shapes, is out of range (also: the CCL buffer is too small)."""


class MoeDistributeError(ValueError):
    """Invalid input to a MoE distribute op.

    ``code`` is the aclnn status the NPU op returns for the same input (161001 null, 161002 invalid dtype or
    parameter, 561002 shape or value); ``param`` names the offending parameter.
    """

    def __init__(self, code: int, param: str, message: str) -> None:
        super().__init__(f"[aclnn {code}] {param}: {message}")
        self.code = code
        self.param = param


def null(param: str, what: str = "is required") -> MoeDistributeError:
    return MoeDistributeError(ACLNN_ERR_PARAM_NULLPTR, param, f"must not be None ({what})")


def invalid(param: str, message: str) -> MoeDistributeError:
    return MoeDistributeError(ACLNN_ERR_PARAM_INVALID, param, message)


def shape(param: str, message: str) -> MoeDistributeError:
    return MoeDistributeError(ACLNN_ERR_INNER_TILING_ERROR, param, message)
