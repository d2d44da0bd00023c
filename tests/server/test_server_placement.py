"""The serving layer on the Ascend path and on other devices.

- Served through real uvicorn over 2 spawned EP workers: a tiny checkpoint's greedy tokens with ``backend: ascend``
  + ``simulate-npu`` (the NPU stand-in ``deep_ep_npu.sim`` installed in every worker) equal those with ``backend:
  reference`` and transformers' own, for Qwen3-MoE and DeepSeek-V3, unfused and ``moe-impl: fused``. These fp32
  checkpoints (hidden 64) take the ascend MegaMoE backend's reference pipeline; a bf16 random model with hidden 128
  and expert size 64 (the fused op's tiling) takes the stand-in fused op ``dispatch_ffn_combine``.
- Start-up errors for impossible device / backend combinations: exit code 2 and a message naming the option, before
  any worker process starts.
- ``device: cuda`` + ``dist-backend: nccl`` at EP 1 on one GPU (marked ``gpu``; skipped without one).
"""

from __future__ import annotations

import multiprocessing as mp
import time

import httpx
import pytest
import torch

from server.api import create_app
from server.api.serve import build_engine
from server.cli import main as cli_main
from server.config import ConfigError, build_config
from server.runtime.engine_config import EngineConfig
from server.runtime.workers import placement
from tests.support.checkpoints import hf_greedy, load_hf, make_checkpoint
from tests.support.serving import UvicornThread

STEPS = 6
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7], [(11 * j) % 250 + 1 for j in range(17)]]
ASCEND_SIM = {"backend": "ascend", "simulate-npu": True}
REFERENCE = {"backend": "reference"}


def _serve_greedy(values: dict, prompts: list[list[int]]) -> tuple[list[list[int]], list[dict]]:
    """Serve ``values`` (EP 2, spawned workers) on real uvicorn; greedy token ids of each prompt over HTTP, and the
    workers' infos."""
    config = build_config({"ep-size": 2, "max-num-seqs": 4, "max-model-len": 64, "log-level": "warning", **values})
    engine = build_engine(config)
    out = []
    with UvicornThread(create_app(config, engine)) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        for prompt in prompts:
            body = {
                "model": config.model_name,
                "prompt": prompt,
                "max_tokens": STEPS,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            out.append(r.json()["choices"][0]["token_ids"])
    assert not engine.workers.is_alive()
    return out, engine.worker_infos


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_ascend_sim_serves_the_reference_and_transformers_tokens(tmp_path, arch: str) -> None:
    path = make_checkpoint(arch, str(tmp_path / arch))
    hf = load_hf(path)
    golden = [hf_greedy(hf, p, STEPS)[0] for p in PROMPTS]
    for impl in ("unfused", "fused"):
        got = {}
        for name, values in (("reference", REFERENCE), ("ascend", ASCEND_SIM)):
            tokens, infos = _serve_greedy({"model": path, "moe-impl": impl, **values}, PROMPTS)
            assert [i.moe_backend for i in infos] == [name, name]
            assert [i.device for i in infos] == ["cpu", "cpu"]
            got[name] = tokens
        assert got["ascend"] == got["reference"], impl
        assert got["reference"] == golden, impl


def test_ascend_sim_fused_op_shapes_match_reference() -> None:
    """bf16, hidden 128, expert size 64: the ascend MegaMoE backend calls the (stand-in) fused op."""
    spec = {"architecture": "deepseek_v3", "hidden_size": 128, "moe_intermediate_size": 64, "head_dim": 32}
    values = {"dtype": "bfloat16", "moe-impl": "fused", "random-model": spec}
    ref, _ = _serve_greedy({**values, **REFERENCE}, PROMPTS[:2])
    sim, infos = _serve_greedy({**values, **ASCEND_SIM}, PROMPTS[:2])
    assert [i.moe_backend for i in infos] == ["ascend", "ascend"]
    assert sim == ref


HAS_NPU = placement.torch_npu_installed()
HAS_CUDA = torch.cuda.is_available()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dist-backend", "hccl"], "dist-backend: 'hccl' needs torch_npu"),
        (["--device", "npu"], "device: 'npu' needs torch_npu"),
        (["--backend", "ascend"], "backend: 'ascend' needs torch_npu"),
        (["--device", "cuda", "--dist-backend", "nccl"], "dist-backend: 'nccl' needs CUDA"),
        (["--device", "cuda"], "device: 'cuda' needs a visible CUDA GPU"),
        (["--simulate-npu", "--device", "cuda"], "simulate-npu: the stand-in runs on CPU tensors over gloo"),
        (["--simulate-npu", "--dist-backend", "nccl"], "simulate-npu: the stand-in runs on CPU tensors over gloo"),
    ],
)
def test_impossible_placements_exit_before_any_worker(capsys, argv: list[str], message: str) -> None:
    if HAS_NPU or (HAS_CUDA and "cuda" in argv):
        pytest.skip("the combination can run here")
    t0 = time.monotonic()
    assert cli_main([*argv, "--port", "0", "--log-level", "warning"]) == 2
    assert time.monotonic() - t0 < 10
    assert mp.active_children() == []  # no worker was started
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: ")


def test_placement_pairs_and_device_count(monkeypatch) -> None:
    """The checks that need devices, on a faked environment: 3 GPUs visible, NCCL present."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(placement, "visible_devices", lambda device: 3)
    placement.check_placement("cuda", "nccl", "reference", False, 3)
    with pytest.raises(ValueError, match=r"ep-size: 4 workers on this machine need 4 cuda devices .*3 visible"):
        placement.check_placement("cuda", "nccl", "auto", False, 4)
    with pytest.raises(ValueError, match="dist-backend: 'gloo' does not carry cuda tensors.*use dist-backend 'nccl'"):
        placement.check_placement("cuda", "gloo", "reference", False, 1)
    with pytest.raises(ValueError, match="dist-backend: 'nccl' does not carry cpu tensors.*use dist-backend 'gloo'"):
        placement.check_placement("cpu", "nccl", "reference", False, 1)
    if not HAS_NPU:
        with pytest.raises(ValueError, match="backend: 'ascend' needs torch_npu"):
            placement.check_placement("cuda", "nccl", "ascend", False, 1)


def test_simulate_npu_config_refusal_names_the_option() -> None:
    with pytest.raises(ConfigError, match="simulate-npu: .*got device 'cuda', dist-backend 'nccl'") as err:
        build_config({"simulate-npu": True, "device": "cuda", "dist-backend": "nccl", "api-key": "s3cret-key"})
    assert "s3cret-key" not in str(err.value)  # the whole-config check does not echo the config
    assert build_config({"simulate-npu": True}).simulate_npu
    # an NPU config (the Ascend A3 one) runs on the stand-in as is: npu / hccl become cpu / gloo for the workers
    npu = build_config({"simulate-npu": True, "device": "npu", "dist-backend": "hccl", "backend": "ascend"})
    engine = EngineConfig.from_server_config(npu)
    assert (npu.device, npu.dist_backend) == ("npu", "hccl") and (engine.device, engine.dist_backend) == ("cpu", "gloo")


@pytest.mark.gpu
@pytest.mark.skipif(
    not (HAS_CUDA and torch.distributed.is_nccl_available()), reason="needs a CUDA GPU and torch.distributed with NCCL"
)
@pytest.mark.parametrize("moe_impl", ["unfused", "fused"])
def test_cuda_nccl_serves_like_cpu(moe_impl: str) -> None:
    """EP 1 on GPU 0 over NCCL (the Buffer is used at EP 1 with moe-impl fused) gives the CPU run's greedy tokens
    (fp32, the default random model); EP 2 too where two GPUs are visible."""
    values = {"moe-impl": moe_impl, "backend": "reference"}
    cpu, _ = _serve_greedy({**values, "ep-size": 1}, PROMPTS)
    ep_sizes = [1, 2] if torch.cuda.device_count() >= 2 else [1]
    for ep in ep_sizes:
        gpu, infos = _serve_greedy({**values, "ep-size": ep, "device": "cuda", "dist-backend": "nccl"}, PROMPTS)
        assert [i.device for i in infos] == [f"cuda:{r}" for r in range(ep)]
        assert gpu == cpu, ep
