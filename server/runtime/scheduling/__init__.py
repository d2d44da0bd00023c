"""The driver's side of a step: requests, KV blocks and their budget, per-rank scheduling into step plans,
and detokenization."""
