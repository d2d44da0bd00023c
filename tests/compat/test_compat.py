"""What other DeepEP ports and engines call besides DeepEP's API: DeepEP-Ascend's ``low_latency_dispatch`` keywords
(``topk_weights``, ``quant_mode``, ``use_mxfp4``), DeepEP's ``get_local_buffer_tensor``, and ``import deep_ep``
through :mod:`deep_ep_npu.alias` (never over a real DeepEP)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from deep_ep_npu import Buffer, MoeDistributeError
from tests.support.distributed import parallel_launch

N, H, E, K = 8, 256, 8, 2
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _inputs(rank: int):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn((5, H), generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(5)])
    return x, idx, torch.rand((5, K), generator=g)


def _ascend_keywords(info):
    buffer = Buffer(info.group, backend="reference")
    x, idx, w = _inputs(info.rank)
    ours = buffer.low_latency_dispatch(x, idx, N, E, quant_format="int8_per_token")
    theirs = buffer.low_latency_dispatch(x, idx, N, E, topk_weights=w, quant_mode="int8")
    counts = ours[1].tolist()  # (rows past recv_count are undefined)
    same = torch.equal(ours[1], theirs[1]) and all(
        torch.equal(a[i, :n], b[i, :n]) for a, b in zip(ours[0], theirs[0], strict=True) for i, n in enumerate(counts)
    )
    plain = buffer.low_latency_dispatch(x, idx, N, E, use_fp8=False, topk_weights=w, quant_mode=None)
    assert torch.equal(plain[1], ours[1])
    errors = []
    for kw in (
        dict(quant_mode="mx_fp8_e4m3"),
        dict(use_mxfp4=True),
        dict(topk_weights=w[:, :1]),
        dict(quant_mode="int8", quant_format="fp8_e4m3"),
        dict(quant_mode="fp16"),
    ):
        bad = kw if info.rank == 1 else {}
        with pytest.raises(MoeDistributeError) as err:
            buffer.low_latency_dispatch(x, idx, N, E, **bad)
        errors.append(str(err.value))
    return same, errors


def test_deepep_ascend_keywords():
    results = parallel_launch(2, _ascend_keywords, timeout=120)
    assert all(same for same, _ in results)
    peer, bad = results[0][1], results[1][1]
    assert all("aborted on every rank: rejected on rank 1" in m for m in peer), peer
    assert "quant_mode: got 'mx_fp8_e4m3' (not implemented here); allowed [None, 'int8']" in bad[0]
    assert "quant_mode: got 'mx_fp4_e2m1'" in bad[1] and "topk_weights: shape (5, 1)" in bad[2], bad
    assert "quant_format: is 'fp8_e4m3'" in bad[3] and "not a DeepEP-Ascend quant_mode" in bad[4], bad


def _local_buffer(info):
    buffer = Buffer(info.group, num_nvl_bytes=64, num_rdma_bytes=1024, backend="reference")
    raw = buffer.get_local_buffer_tensor(torch.int8, use_rdma_buffer=True)
    assert raw.shape == (1024,) and raw.dtype == torch.int8 and not raw.any()
    raw.fill_(3)
    floats = buffer.get_local_buffer_tensor(torch.float32, torch.Size([2, 4]), offset=8, use_rdma_buffer=True)
    assert floats.shape == (2, 4) and torch.equal(floats.view(torch.uint8), torch.full((2, 16), 3, dtype=torch.uint8))
    buffer.get_local_buffer_tensor(torch.int8, use_rdma_buffer=True).zero_()  # vLLM's clean_buffers
    assert not floats.any() and buffer.get_local_buffer_tensor(torch.bfloat16).shape == (32,)
    for args, match in (
        ((torch.float32, torch.Size([17])), "size"),
        ((torch.float32, None, 2), "offset"),
        ((torch.int8, None, 65), "offset"),
    ):
        with pytest.raises(ValueError, match=match):
            buffer.get_local_buffer_tensor(*args)
    return True


def test_get_local_buffer_tensor():
    assert all(parallel_launch(2, _local_buffer, timeout=60))


def _python(code: str, path: str = "") -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (path, REPO) if p)}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return out.stdout.strip()


def test_import_deep_ep_alias(tmp_path):
    code = """
        import importlib.util
        assert importlib.util.find_spec("deep_ep") is None  # opt-in: nothing answers before install()
        import deep_ep_npu.alias
        print(deep_ep_npu.alias.install(), deep_ep_npu.alias.install())
        import deep_ep, deep_ep.utils.event
        import deep_ep_npu
        print(deep_ep.Buffer is deep_ep_npu.Buffer, deep_ep.Config is deep_ep_npu.Config,
              deep_ep.utils.event.EventOverlap is deep_ep_npu.EventOverlap, deep_ep.topk_idx_t)
    """
    assert _python(code).splitlines() == ["True True", "True True True torch.int64"]
    real = tmp_path / "deep_ep"
    real.mkdir()
    (real / "__init__.py").write_text("REAL = True\n")
    code = """
        import deep_ep_npu.alias
        print(deep_ep_npu.alias.install())
        import deep_ep
        print(getattr(deep_ep, "REAL", False))
    """
    assert _python(code, str(tmp_path)).splitlines() == ["False", "True"]  # a real DeepEP stays deep_ep


def test_import_deep_ep_by_pythonpath(tmp_path):
    folder = _python("import runpy; runpy.run_module('deep_ep_npu.alias', run_name='__main__')")
    assert os.path.isdir(os.path.join(folder, "deep_ep"))
    code = """
        import deep_ep, deep_ep.utils.event, deep_ep_npu
        print(deep_ep.Buffer is deep_ep_npu.Buffer, deep_ep.utils.event.EventOverlap is deep_ep_npu.EventOverlap)
    """
    assert _python(code, folder) == "True True"
    real = tmp_path / "deep_ep"
    real.mkdir()
    (real / "__init__.py").write_text("REAL = True\n")
    code = f"import deep_ep; print(getattr(deep_ep, 'REAL', False), deep_ep.__file__.startswith({str(tmp_path)!r}))"
    assert _python(code, os.pathsep.join((folder, str(tmp_path)))) == "True True"  # ours first on the path: defers


def test_vllm_plugin_entry_point():
    tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        plugins = tomllib.load(f)["project"]["entry-points"]["vllm.general_plugins"]
    assert plugins == {"deep_ep_npu": "deep_ep_npu.alias.vllm_plugin:register"}
    code = """
        import importlib.util
        from deep_ep_npu.alias.vllm_plugin import register
        register()
        spec = importlib.util.find_spec("deep_ep")  # vLLM's has_deep_ep()
        import deep_ep, deep_ep_npu
        print(spec is not None, deep_ep.Buffer is deep_ep_npu.Buffer)
    """
    assert _python(code) == "True True"
