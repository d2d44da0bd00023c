"""The parameter core: one description of an EP call (:mod:`.call`) and one rule set that validates it
(:mod:`.rules`, with the Ascend ops' platform rules in :mod:`.ascend` / :mod:`.platforms` and DeepEP V2's in
:mod:`.elastic`). Front-ends map their own arguments onto it."""
