"""Structured output: grammars (JSON schema, regex, choice, EBNF) compiled with xgrammar for the served tokenizer
(:mod:`.compiler`, driver side, off the engine loop) and applied to each constrained request's logits where its
tokens are sampled (:mod:`.matcher`, worker side)."""
