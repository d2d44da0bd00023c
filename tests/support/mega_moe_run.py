"""The fused MegaMoE call of one rank as the tests make it (``mega_moe`` or ``Buffer.mega_moe``), for
:func:`tests.support.distributed.parallel_launch`."""

from __future__ import annotations

from tests.support.mega_moe_oracle import Case


def run_fused(info, case: Case, kwargs: dict):
    """``mega_moe(group, ...)``, or ``Buffer.mega_moe(...)`` with ``via_buffer=True`` (on the Buffer backend
    ``kwargs["backend"]``, default reference); ``sim=True`` installs deep_ep_npu.sim first. The case's active prefix
    and swiglu_limit are passed when it has them."""
    from deep_ep_npu import Buffer, sim
    from deep_ep_npu.mega_moe import mega_moe

    kwargs = dict(kwargs)
    if kwargs.pop("sim", False):
        sim.install()
    x, idx, p, w1, w2, *_ = case.rank_args(info.rank)
    kw = case.keywords(info.rank, info.world_size)
    if case.active is not None:
        kw["x_active_mask"] = case.mask(info.rank)
    if case.swiglu_limit:
        kw["swiglu_limit"] = case.swiglu_limit
    if kwargs.pop("via_buffer", False):
        buf = Buffer(info.group, backend=kwargs.pop("backend", "reference"), explicitly_destroy=True)
        out = buf.mega_moe(x, idx, p, w1, w2, **kw, **kwargs)
        buf.destroy()
        return out
    return mega_moe(info.group, x, idx, p, w1, w2, **kw, **kwargs)
