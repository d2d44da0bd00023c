"""The engine (README "Architecture"): :mod:`.exchange` (dispatch and combine, the ``reference`` backend), the layouts
:mod:`.masked` (DeepEP), :mod:`.flat` (Ascend, its TP stage :mod:`.tp`) and :mod:`.expand` (DeepEP V2), :mod:`.plan`,
:mod:`.rows`, :mod:`.reduce`, MegaMoE's :mod:`.pipeline` and :mod:`.ffn`; CPU loops in :mod:`deep_ep_npu.kernels`."""
