"""The one exchange engine: moves rows between ranks and places them by a layout.

A dispatch, top-down: :mod:`.plan` (which rows go to which rank) -> :mod:`.rows` (their bytes) ->
:mod:`.dispatch` (agreement step, payload all-to-all over :class:`~deep_ep_npu.group.EPGroup`) -> :mod:`.layouts`
(DeepEP's masked or Ascend's flat placement). :mod:`.combine` returns and reduces rows; :mod:`.flat` and
:mod:`.masked` build the jobs of the two layouts; :mod:`.tp` and :mod:`.special` are the Ascend extras.
"""
