"""The one exception type of the library's argument checks, with the aclnn status code of the matching NPU failure
(the checks themselves: :mod:`deep_ep_npu.core.rules`)."""

from __future__ import annotations

import functools
from collections.abc import Mapping

ACLNN_ERR_PARAM_NULLPTR = 161001  # a required tensor or argument is missing (None)
ACLNN_ERR_PARAM_INVALID = 161002  # a dtype or a parameter value is not supported
ACLNN_ERR_INNER_TILING_ERROR = 561002  # a shape, or a value derived from shapes, is out of range (or CCL too small)


class MoeDistributeError(ValueError):
    """Invalid input to a MoE distribute op, a buffer or MegaMoE. ``code`` is the aclnn status the NPU op returns for
    the same input (161001 null, 161002 invalid dtype or parameter, 561002 shape or value); ``param`` names the
    offending parameter."""

    def __init__(self, code: int, param: str, message: str) -> None:
        super().__init__(f"[aclnn {code}] {param}: {message}")
        self.code, self.param, self.detail = code, param, message

    def renamed(self, names: Mapping[str, str]) -> MoeDistributeError:
        """The same error naming the caller's parameter: ``names`` maps the core's parameter names to the caller's."""
        if self.param not in names:
            return self
        return MoeDistributeError(self.code, names[self.param], self.detail)


invalid = functools.partial(MoeDistributeError, ACLNN_ERR_PARAM_INVALID)  # invalid(param, message)
shape = functools.partial(MoeDistributeError, ACLNN_ERR_INNER_TILING_ERROR)  # shape(param, message)


def null(param: str, what: str = "is required") -> MoeDistributeError:
    return MoeDistributeError(ACLNN_ERR_PARAM_NULLPTR, param, f"must not be None ({what})")
