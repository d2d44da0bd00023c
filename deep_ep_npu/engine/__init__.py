"""The one exchange engine: moves rows between ranks and places them by a layout.

A dispatch: :mod:`.plan` (which rows go to which rank) -> :mod:`.rows` (their bytes) -> :mod:`.dispatch` (agreement
step, payload all-to-all over :class:`~deep_ep_npu.group.EPGroup`) -> :mod:`.layouts` (DeepEP's masked placement) or
:mod:`.flat` (Ascend's flat placement, with the TP stage and copy / const experts). :mod:`.combine` returns and
reduces rows. :mod:`.transport` chooses how a Buffer's rows move: the collective path above, or :mod:`.shm` (the same
jobs through a shared-memory window of the ranks of one host, :mod:`.window`). :mod:`deep_ep_npu.kernels` runs the
plan, the packing, the masked placement and the fp32 reduction of CPU tensors in C, bit-identical to the torch code."""
