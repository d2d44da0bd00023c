"""End-to-end runtime tests: W spawned workers in lockstep, served from a tiny HF checkpoint, vs transformers.

Golden: greedy tokens identical to transformers' (fp32, 16 steps) for 8 prompts of different lengths at EP 1, 2
and 4, with a per-step capacity N=16 so longer prompts are prefilled in chunks and 4 slots per worker so some
requests wait for a slot.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from server import LLM, SamplingParams
from server.runtime import WorkerError
from server.runtime.workers.worker import PlanEntry, StepPlan
from tests.support.checkpoints import hf_greedy, load_hf, make_checkpoint

STEPS = 16
PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(n)] for i, n in enumerate([1, 5, 40, 9, 23, 2, 17, 33])]
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> tuple[str, list[list[int]]]:  # noqa: ANN001
    path = make_checkpoint("qwen3_moe", str(tmp_path_factory.mktemp("qwen")))
    hf = load_hf(path)
    return path, [hf_greedy(hf, p, STEPS)[0] for p in PROMPTS]


@pytest.fixture(scope="module")
def llm_ep2(qwen):  # noqa: ANN001, ANN201
    llm = LLM(model=qwen[0], ep_size=2, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=128)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("ep_size", [1, 4])
def test_greedy_matches_transformers(qwen, ep_size: int) -> None:  # noqa: ANN001
    path, golden = qwen
    with LLM(model=path, ep_size=ep_size, **ENGINE) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == golden
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        infos = llm.engine.worker_infos
        assert [i.num_local_experts for i in infos] == [8 // ep_size] * ep_size
    assert not any(p.is_alive() for p in llm.engine.workers.procs)


def test_greedy_matches_transformers_ep2_and_expert_memory_halves(qwen, llm_ep2) -> None:  # noqa: ANN001
    outs = llm_ep2.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == qwen[1]
    infos = llm_ep2.engine.worker_infos
    full_expert_bytes = 2 * 8 * 3 * 32 * 64 * 4  # 2 MoE layers x 8 experts x (gate, up, down) [32 x 64] fp32
    assert [i.expert_bytes for i in infos] == [full_expert_bytes // 2] * 2


def test_batch_invariance(llm_ep2) -> None:  # noqa: ANN001
    """A request's greedy output is the same alone and inside a batch of 16 mixed-length requests."""
    batch = [[(11 * i + 5 * j) % 256 for j in range(1 + (i * 7) % 30)] for i in range(16)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm_ep2.generate(batch, params)]
    for i in (0, 5, 13):
        assert llm_ep2.generate([batch[i]], params)[0].outputs[0].token_ids == together[i]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm_ep2) -> None:  # noqa: ANN001
    prompt = PROMPTS[3]
    sp = [SamplingParams(max_tokens=12, temperature=1.5, seed=s, ignore_eos=True) for s in (1, 1, 2)]
    a, b, c = (o.outputs[0].token_ids for o in llm_ep2.generate([prompt] * 3, sp))
    assert a == b and a != c
    alone = llm_ep2.generate(prompt, sp[0])[0].outputs[0].token_ids
    assert alone == a
    top1 = SamplingParams(max_tokens=12, temperature=1.0, top_k=1, ignore_eos=True)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert (
        llm_ep2.generate(prompt, top1)[0].outputs[0].token_ids
        == llm_ep2.generate(prompt, greedy)[0].outputs[0].token_ids
    )


def test_n_samples_logprobs_and_prompt_logprobs_offline(qwen, llm_ep2) -> None:  # noqa: ANN001
    """vLLM's offline shapes: ``n`` outputs (sample i seeded seed + i), ``logprobs`` per generated token as
    ``{token_id: logprob}`` with the sampled token and the top alternatives, ``prompt_logprobs`` per prompt token."""
    prompt = PROMPTS[3]
    out = llm_ep2.generate(prompt, SamplingParams(max_tokens=6, temperature=1.2, seed=5, n=3, ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    for i, o in enumerate(out.outputs):
        alone = SamplingParams(max_tokens=6, temperature=1.2, seed=5 + i, ignore_eos=True)
        assert o.token_ids == llm_ep2.generate(prompt, alone)[0].outputs[0].token_ids
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=0)
    g = llm_ep2.generate(prompt, greedy)[0]
    assert g.outputs[0].token_ids == qwen[1][3][:4]
    for token, entry in zip(g.outputs[0].token_ids, g.outputs[0].logprobs, strict=True):
        assert token in entry and len(entry) == 2 and entry[token] == max(entry.values())  # greedy: the best
    assert g.prompt_logprobs[0] is None and len(g.prompt_logprobs) == len(prompt)
    assert all(list(d) == [t] for d, t in zip(g.prompt_logprobs[1:], prompt[1:], strict=True))


def test_stop_token_ids_stop_strings_and_text(qwen, llm_ep2) -> None:  # noqa: ANN001
    prompt, golden = PROMPTS[1], qwen[1][1]
    full = llm_ep2.generate(prompt, GREEDY)[0].outputs[0]
    assert full.text == llm_ep2.tokenizer.decode(golden)
    stop_id = golden[6]
    out = llm_ep2.generate(prompt, SamplingParams(max_tokens=STEPS, temperature=0, stop_token_ids=[stop_id]))[0]
    cut = golden.index(stop_id) + 1
    assert out.outputs[0].token_ids == golden[:cut] and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].text == llm_ep2.tokenizer.decode(golden[: cut - 1])
    stop = full.text[3:5]
    out = llm_ep2.generate(prompt, SamplingParams(max_tokens=STEPS, temperature=0, stop=stop, ignore_eos=True))[0]
    assert out.outputs[0].text == full.text[: full.text.index(stop)] and out.outputs[0].finish_reason == "stop"
    text_prompt = llm_ep2.generate("hello", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert text_prompt.prompt_token_ids == list(b"hello") and len(text_prompt.outputs[0].token_ids) == 3


def test_engine_abort_and_bad_input(llm_ep2) -> None:  # noqa: ANN001
    engine = llm_ep2.engine
    engine.add_request("a", PROMPTS[2], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    engine.add_request("b", PROMPTS[0], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    engine.step()
    engine.abort_request("a")
    deltas = engine.step()
    assert any(d.request_id == "a" and d.finish_reason == "abort" for d in deltas)
    while engine.has_unfinished_requests():
        deltas += engine.step()
    assert [d.finish_reason for d in deltas if d.request_id == "b"][-1] == "length"
    assert engine.last_step_stats().step_time > 0 and len(engine.last_step_stats().dispatch_times) == 2
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request("c", [], SamplingParams())
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        engine.add_request("c", [3, 999], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len=128"):
        engine.add_request("c", [1] * 128, SamplingParams())
    assert engine.is_healthy()


def test_worker_exception_mid_step_surfaces_and_tears_down(qwen) -> None:  # noqa: ANN001
    """Rank 1 fails inside the forward while rank 0 waits in a dispatch: the caller gets rank 1's traceback and
    every worker is gone within seconds."""
    llm = LLM(model=qwen[0], ep_size=2, **ENGINE)
    procs = llm.engine.workers.procs
    good = StepPlan([PlanEntry(0, 0, [1, 2, 3], True, GREEDY, [0], True)])
    bad = StepPlan([PlanEntry(0, 0, [1, 2, 3], True, GREEDY, [10**6], True)])  # no such block in the worker's cache
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"(?s)worker 1 .*Traceback.*IndexError"):
        llm.engine.workers.step([good, bad])
    assert time.monotonic() - t0 < 15
    assert not any(p.is_alive() for p in procs)
    llm.shutdown()


def test_worker_load_failure_surfaces(qwen, tmp_path) -> None:  # noqa: ANN001
    """A NaN in one of rank 1's experts (only that worker reads it): LLM() raises with that worker's one-line
    error naming the tensor, nothing is left. (A missing tensor is refused before any worker starts:
    tests/server/test_broken_ckpt.py.)"""
    from safetensors.torch import load_file, save_file

    path = str(tmp_path / "broken")
    os.makedirs(path)
    for name in ("config.json", "generation_config.json"):
        with open(os.path.join(qwen[0], name)) as src, open(os.path.join(path, name), "w") as dst:
            dst.write(src.read())
    tensors = load_file(os.path.join(qwen[0], "model.safetensors"))
    tensors["model.layers.1.mlp.experts.7.up_proj.weight"][0, 0] = float("nan")
    save_file(tensors, os.path.join(path, "model.safetensors"))
    children_before = set(_children())
    with pytest.raises(
        WorkerError,
        match=r"^worker 1: checkpoint file .*'model.layers.1.mlp.experts.7.up_proj.weight' holds 1 non-finite",
    ):
        LLM(model=path, ep_size=2, **ENGINE)
    time.sleep(0.2)
    assert not set(_children()) - children_before


def _children() -> list[int]:
    import glob

    me = str(os.getpid())
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":
            out.append(int(stat.split("/")[2]))
    return out


def _torchrun_rank(info, path: str) -> list[list[int]] | None:  # noqa: ANN001
    from server.runtime import EngineConfig, run_worker_from_env

    if info.rank == 0:
        with LLM(model=path, ep_size=info.world_size, launch="torchrun", **ENGINE) as llm:
            return [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], GREEDY)]
    run_worker_from_env(EngineConfig(model=path, ep_size=info.world_size, launch="torchrun", **ENGINE))
    return None


def test_torchrun_mode(qwen) -> None:  # noqa: ANN001
    """Under a torchrun-style group: rank 0 drives and is worker 0, rank 1 runs run_worker_from_env."""
    from tests.support.distributed import parallel_launch

    results = parallel_launch(2, _torchrun_rank, qwen[0], timeout=120)
    assert results[0] == qwen[1][:4] and results[1] is None


def test_bad_engine_arguments() -> None:
    with pytest.raises(ValueError, match="ep_size=3 must divide"):
        LLM(ep_size=3)
    with pytest.raises(ValueError, match="dtype='int4'"):
        LLM(dtype="int4")
    with pytest.raises(ValueError, match="max_num_batched_tokens=4 must be >= max_num_seqs=8"):
        LLM(max_num_seqs=8, max_num_batched_tokens=4)
    assert torch.get_num_threads() >= 1


@pytest.mark.parametrize("arch", ["deepseek_v3", "mixtral"])
def test_other_architectures_greedy_ep2(arch: str, tmp_path) -> None:  # noqa: ANN001
    """DeepSeek-V3 (MLA, grouped sigmoid routing, shared experts, dense first layer) and Mixtral served at EP 2."""
    path = make_checkpoint(arch, str(tmp_path / arch))
    hf = load_hf(path)
    prompts = PROMPTS[:4]
    golden = [hf_greedy(hf, p, STEPS)[0] for p in prompts]
    with LLM(model=path, ep_size=2, **ENGINE) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == golden
