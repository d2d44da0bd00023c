"""Model golden tests at EP 1 (in process): every family (Qwen3-MoE, DeepSeek-V3, Mixtral, Qwen2-MoE, OLMoE,
GLM-4.5) vs transformers in fp32.

Tolerance: logits within 1e-4 absolute of transformers' (observed ~2e-7; logits are O(1)).
"""

from __future__ import annotations

import pytest
import torch

from server.loader import CheckpointTensors, build_model, load_model, random_hf_config, read_config, read_hf_config
from server.models import ExpertComm, LocalComm, ModelConfig
from tests.support.checkpoints import hf_greedy, load_hf, make_checkpoint
from tests.support.golden import ATOL, PROMPTS
from tests.support.paged import SlotCache

ARCHS = ["qwen3_moe", "deepseek_v3", "mixtral", "qwen2_moe", "olmoe", "glm4_moe", "gpt_oss"]


@pytest.fixture(scope="module", params=ARCHS)
def ckpt(request, tmp_path_factory) -> tuple[str, str]:  # noqa: ANN001
    return request.param, make_checkpoint(request.param, str(tmp_path_factory.mktemp(request.param)))


def _local(cfg: ModelConfig) -> LocalComm:
    return LocalComm(cfg.num_experts, 64)


def test_logits_and_greedy_match_transformers(ckpt) -> None:  # noqa: ANN001
    """Prefill of a mixed-length batch, then 8 batched decode steps: logits close, greedy tokens identical."""
    _, path = ckpt
    hf = load_hf(path)
    model = load_model(path, _local)
    cache = SlotCache(model, len(PROMPTS), 64)
    steps = 8
    golden = [hf_greedy(hf, p, steps) for p in PROMPTS]
    logits = cache.run(model, [(i, 0, p) for i, p in enumerate(PROMPTS)], [True] * len(PROMPTS))
    lengths = [len(p) for p in PROMPTS]
    for step in range(steps):
        for i, (tokens, ref) in enumerate(golden):
            torch.testing.assert_close(logits[i], ref[step], atol=ATOL, rtol=0)
            assert int(logits[i].argmax()) == tokens[step]
        chunks = [(i, lengths[i] + step, [golden[i][0][step]]) for i in range(len(PROMPTS))]
        logits = cache.run(model, chunks, [True] * len(PROMPTS))


def test_chunked_prefill_equals_whole(ckpt) -> None:  # noqa: ANN001
    """A prompt prefilled in three chunks gives the same last logits as one pass (and as transformers)."""
    _, path = ckpt
    model = load_model(path, _local)
    prompt = PROMPTS[2]
    cache = SlotCache(model, 2, 64)
    whole = cache.run(model, [(0, 0, prompt)], [True])
    cache.run(model, [(1, 0, prompt[:4])], [False])
    cache.run(model, [(1, 4, prompt[4:7])], [False])
    chunked = cache.run(model, [(1, 7, prompt[7:])], [True])
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)
    _, ref = hf_greedy(load_hf(path), prompt, 1)
    torch.testing.assert_close(chunked[0], ref[0], atol=ATOL, rtol=0)


class _NoComm(ExpertComm):
    def dispatch(self, x, topk_idx):  # noqa: ANN001, ANN201
        raise AssertionError("not used")

    def combine(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        raise AssertionError("not used")


class _Recorder(CheckpointTensors):
    """Records the tensors read and, of the routed experts, which experts (by name, or by rows of fused tensors)."""

    def __init__(self, path: str) -> None:
        super().__init__(path, read_hf_config(path)[0])
        self.read: list[str] = []
        self.experts: set[int] = set()

    def get(self, read):  # noqa: ANN001, ANN201
        self.read.append(read.name)
        if read.rows is not None:
            self.experts |= set(read.rows)
        elif ".experts." in read.name:
            self.experts.add(int(read.name.split(".experts.")[1].split(".")[0]))
        return super().get(read)


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_rank_reads_only_its_experts(ckpt, num_ranks: int) -> None:  # noqa: ANN001
    """Rank r of an EP group reads exactly experts [r*L, (r+1)*L) and every non-expert tensor, bit-exact."""
    arch, path = ckpt
    cfg = read_config(path)
    full = load_model(path, _local)
    for rank in range(num_ranks):
        tensors = _Recorder(path)
        model = build_model(cfg, _NoComm(rank, num_ranks, cfg.num_experts, 8), torch.float32, tensors)
        per_rank = cfg.num_experts // num_ranks
        assert tensors.experts == set(range(rank * per_rank, (rank + 1) * per_rank))
        assert (
            not set(tensors.files.weight_map)
            - set(tensors.read)
            - {k for k in tensors.files.weight_map if ".experts." in k and ".shared_experts." not in k}
        )
        for moe, moe_full in zip(model.moe_layers(), full.moe_layers(), strict=True):
            sl = slice(rank * per_rank, (rank + 1) * per_rank)
            assert torch.equal(moe.experts.w13, moe_full.experts.w13[sl])
            assert torch.equal(moe.experts.w2, moe_full.experts.w2[sl])
            for bias in ("b13", "b2"):
                if hasattr(moe.experts, bias):
                    assert torch.equal(getattr(moe.experts, bias), getattr(moe_full.experts, bias)[sl])
        assert model.moe_layers()[0].experts.w13.shape[0] == per_rank


@pytest.mark.parametrize("arch", ARCHS)
def test_random_model_is_deterministic_and_sliced(arch: str) -> None:
    """A random model from a seed: same weights twice, rank slices equal the EP-1 experts, seeds differ."""
    spec = {"architecture": arch}
    cfg = ModelConfig.from_hf(random_hf_config(spec))
    a = load_model(None, _local, seed=3, random_model=spec)
    b = load_model(None, _local, seed=3, random_model=spec)
    c = load_model(None, _local, seed=4, random_model=spec)
    for (name, pa), pb, pc in zip(
        a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
    from server.loader import RandomTensors

    half = build_model(cfg, _NoComm(1, 2, cfg.num_experts, 8), torch.float32, RandomTensors(3))
    e = cfg.num_experts // 2
    assert torch.equal(half.moe_layers()[-1].experts.w2, a.moe_layers()[-1].experts.w2[e:])


def test_bfloat16_model_runs_close_to_fp32() -> None:
    """dtype=bfloat16 materialises bf16 weights (routers stay fp32) and stays near the fp32 logits."""
    m32 = load_model(None, _local, dtype="float32")
    m16 = load_model(None, _local, dtype="bfloat16")
    assert m16.model.embed_tokens.weight.dtype == torch.bfloat16
    assert m16.moe_layers()[0].gate.weight.dtype == torch.float32
    chunks = [(0, 0, list(b"hello world"))]
    l32 = SlotCache(m32, 1, 32).run(m32, chunks, [True])
    l16 = SlotCache(m16, 1, 32, torch.bfloat16).run(m16, chunks, [True])
    assert (l16 - l32).abs().max() < 0.1 * l32.abs().max()


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_int8_experts_close_to_float(arch: str) -> None:
    """W8A8 experts (per-channel weight scales, per-token activation quant; gpt-oss' biases stay float) stay within
    ~2% of fp32 logits."""
    model = load_model(None, _local, random_model={"architecture": arch})
    chunks = [(0, 0, list(b"the quick brown fox")), (1, 0, list(b"hi"))]
    ref = SlotCache(model, 2, 32).run(model, chunks, [True, True])
    for moe in model.moe_layers():
        moe.experts.quantize_int8()
    out = SlotCache(model, 2, 32).run(model, chunks, [True, True])
    assert not torch.equal(out, ref)
    assert (out - ref).abs().max() < 0.02 * ref.abs().max()


def test_fused_moe_refuses_gpt_oss_experts() -> None:
    """Buffer.mega_moe runs plain SwiGLU without biases: gpt-oss' clamped, biased experts are refused, not run."""

    class FusedLocal(LocalComm):
        fused = True

    with pytest.raises(ValueError, match="gpt_oss's experts need the unfused path"):
        load_model(None, lambda cfg: FusedLocal(cfg.num_experts, 8), random_model={"architecture": "gpt_oss"})


def test_unknown_architecture_is_rejected() -> None:
    with pytest.raises(ValueError, match="architectures=.*LlamaForCausalLM.*supported"):
        ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ValueError, match="architecture='gpt2'"):
        random_hf_config({"architecture": "gpt2"})


@pytest.mark.parametrize("arch", ARCHS)
def test_zero_token_step(arch: str) -> None:
    """A worker with no work runs the forward with zero tokens (it must still enter every MoE layer)."""
    model = load_model(None, _local, random_model={"architecture": arch})
    calls = []
    for moe in model.moe_layers():
        moe.register_forward_hook(lambda mod, inp, out: calls.append(out.shape))
    out = SlotCache(model, 1, 8).run(model, [], [])
    assert out.shape == (0, model.cfg.vocab_size)
    assert calls == [(0, model.cfg.hidden_size)] * len(model.moe_layers())


def test_routing_is_decisive(tmp_path) -> None:  # noqa: ANN001
    """The scaled router leaves a clear gap between the k-th and (k+1)-th expert probability."""
    model = load_hf(make_checkpoint("qwen3_moe", str(tmp_path / "q")))
    x = torch.randn(256, 64)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))
    probs = torch.softmax(x @ model.model.layers[0].mlp.gate.weight.T, dim=-1)
    top = probs.topk(3, dim=-1).values
    assert (top[:, 1] - top[:, 2]).median() > 1e-2
