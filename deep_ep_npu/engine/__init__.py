"""The engine: one dispatch and one combine for every layout and transport (:mod:`.exchange`, the ``reference``
backend), with :mod:`.plan` (which rows go where), :mod:`.rows` (their bytes), the layouts :mod:`.masked` (DeepEP),
:mod:`.flat` (Ascend, with the TP stage :mod:`.tp`) and :mod:`.expand` (DeepEP V2), :mod:`.reduce` (combine's fp32
sums), MegaMoE's :mod:`.pipeline` and :mod:`.ffn`, on the CPU kernels (:mod:`deep_ep_npu.kernels`)."""
