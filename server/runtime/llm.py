"""The offline API, as in vLLM: ``LLM(model=..., ep_size=..., dtype=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from server.engine_api import SamplingParams, TokenLogprob
from server.runtime.engine import EPEngine


@dataclasses.dataclass
class CompletionOutput:
    """One sample. ``logprobs`` (with ``SamplingParams.logprobs``): per generated token, ``{token_id: logprob}`` of
    the sampled token and the most likely alternatives (plain floats, where vLLM has ``Logprob`` objects)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None


@dataclasses.dataclass
class RequestOutput:
    """One prompt's result: ``SamplingParams.n`` outputs; ``prompt_logprobs`` (with
    ``SamplingParams.prompt_logprobs``) per prompt token as in :class:`CompletionOutput` (the first is None)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    prompt_logprobs: list[dict[int, float] | None] | None = None


def logprob_dict(logprob: TokenLogprob | None) -> dict[int, float] | None:
    """``{token_id: logprob}`` of a position's token and its top alternatives."""
    if logprob is None:
        return None
    return {logprob.token_id: logprob.logprob, **dict(logprob.top)}


Prompt = str | Sequence[int] | dict


class LLM:
    """Start an :class:`EPEngine` (W local workers, or a torchrun job's rank 0) and generate offline.

    Keyword arguments are :class:`EPEngine`'s (``model``, ``ep_size``, ``dtype``, ``max_num_seqs``, ...). Use as a
    context manager or call :meth:`shutdown`; workers are also stopped when the object is collected or at exit.
    """

    def __init__(self, model: str | None = None, ep_size: int = 1, dtype: str = "float32", **kwargs: Any) -> None:
        self.engine = EPEngine(model=model, ep_size=ep_size, dtype=dtype, **kwargs)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One :class:`RequestOutput` per prompt, in order, each with ``n`` outputs. A prompt is a string, a list
        of token ids, or a dict with ``prompt`` or ``prompt_token_ids``."""
        single = isinstance(prompts, (str, dict)) or (
            isinstance(prompts, Sequence) and bool(prompts) and isinstance(prompts[0], int)
        )
        items: list[Prompt] = [prompts] if single else list(prompts)  # type: ignore[list-item,arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(items) if isinstance(sampling_params, SamplingParams) else sampling_params
        if len(params) != len(items):
            raise ValueError(f"got {len(params)} sampling_params for {len(items)} prompts")
        results: list[RequestOutput] = []
        samples: dict[str, tuple[RequestOutput, CompletionOutput]] = {}
        for prompt, p in zip(items, params, strict=True):
            text, ids = self._tokenize(prompt)
            result = RequestOutput(str(next(self._ids)), text, ids, [])
            results.append(result)
            for i in range(p.n):
                request_id = f"{result.request_id}-{i}"
                self.engine.add_request(request_id, ids, p.for_sample(i))
                out = CompletionOutput(i, "", [], None, None if p.logprobs is None else [])
                result.outputs.append(out)
                samples[request_id] = (result, out)
        try:
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    result, out = samples[delta.request_id]
                    out.token_ids.extend(delta.new_token_ids)
                    out.text, out.finish_reason = delta.text, delta.finish_reason
                    if out.logprobs is not None and delta.logprobs:
                        out.logprobs.extend(logprob_dict(lp) for lp in delta.logprobs)  # type: ignore[misc]
                    if delta.prompt_logprobs is not None and result.prompt_logprobs is None:
                        result.prompt_logprobs = [logprob_dict(lp) for lp in delta.prompt_logprobs]
        except BaseException:
            for request_id in samples:
                self.engine.abort_request(request_id)
            raise
        return results

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        return None, list(prompt)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
