"""Broken checkpoints fail loudly: ``python -m server`` stops with exit code 2 and one line naming the file and the
tensor (no traceback) for a NaN weight (found by the worker loading it), a missing tensor and a truncated file
(found by the driver from the headers, before any worker starts); the other faults are checked on
:func:`server.loader.read_config` directly. At run time, non-finite logits fail their request with an error."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from server.api import create_app
from server.api.serve import build_engine
from server.checkpoint import CheckpointError
from server.config import build_config
from server.loader import load_model, read_config
from server.models import LocalComm
from tests.support.checkpoints import make_checkpoint
from tests.support.serving import UvicornThread

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ATTN = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> str:  # noqa: ANN001
    return make_checkpoint("qwen3_moe", str(tmp_path_factory.mktemp("good")))


def _copy(good: str, tmp_path, edit) -> tuple[str, str]:  # noqa: ANN001
    """A copy of ``good`` whose tensors ``edit(dict)`` changed; returns (dir, its safetensors path)."""
    path = str(tmp_path / "ckpt")
    shutil.copytree(good, path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return path, file


def _serve(path: str) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "server", "--model", path, "--port", "0", "--ep-size", "1", "--log-level", "error"]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stderr.strip()


def _nan(tensors: dict) -> None:
    tensors[ATTN][3, 5] = float("nan")


def test_nan_weight_stops_start_up_naming_file_and_tensor(good: str, tmp_path) -> None:  # noqa: ANN001
    path, file = _copy(good, tmp_path, _nan)
    code, err = _serve(path)
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("error: cannot start the engine: worker 0: ")
    assert file in err and repr(ATTN) in err and "1 non-finite value(s)" in err


def test_missing_tensor_stops_start_up_naming_it(good: str, tmp_path) -> None:  # noqa: ANN001
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    path, file = _copy(good, tmp_path, lambda t: t.pop(name))
    code, err = _serve(path)
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert f"tensor {name!r} is missing" in err and file in err


def test_truncated_file_stops_start_up_naming_it(good: str, tmp_path) -> None:  # noqa: ANN001
    path = str(tmp_path / "ckpt")
    shutil.copytree(good, path)
    file = os.path.join(path, "model.safetensors")
    os.truncate(file, os.path.getsize(file) - 1000)
    code, err = _serve(path)
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "model.safetensors is truncated" in err and file in err and "ends at byte" in err


def test_shape_that_disagrees_with_the_config(good: str, tmp_path) -> None:  # noqa: ANN001
    path, file = _copy(good, tmp_path, lambda t: t.update({ATTN: t[ATTN][:-1].clone()}))
    with pytest.raises(CheckpointError, match=rf"{file}: tensor '{ATTN}' has shape \(63, 64\), config.json needs "):
        read_config(path)


def test_quantized_tensor_without_a_format_is_not_cast(good: str, tmp_path) -> None:  # noqa: ANN001
    path, _ = _copy(good, tmp_path, lambda t: t.update({ATTN: t[ATTN].to(torch.float8_e4m3fn)}))
    with pytest.raises(
        CheckpointError,
        match=f"'{ATTN}' is stored as F8_E4M3 .quantized., but config.json declares no quantization_config",
    ):
        read_config(path)


def test_sharded_checkpoint_faults(tmp_path) -> None:  # noqa: ANN001
    """A shard the index names but that is absent, a tensor its shard lacks, a header that is not safetensors'."""
    path = make_checkpoint("mixtral", str(tmp_path / "m"), max_shard_size="60KB")
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    shard = weight_map[ATTN]
    shard_path = os.path.join(path, shard)
    with open(shard_path, "rb") as f:
        data = f.read()
    os.rename(shard_path, shard_path + ".bak")
    with pytest.raises(CheckpointError, match=f"{shard_path}: missing .the index puts tensor"):
        read_config(path)
    tensors = load_file(shard_path + ".bak")
    tensors.pop(ATTN)
    save_file(tensors, shard_path)
    with pytest.raises(CheckpointError, match=f"{shard_path}: has no tensor '{ATTN}', which"):
        read_config(path)
    with open(shard_path, "wb") as f:
        f.write(data[:8] + b"{not json" + data[17:])
    with pytest.raises(CheckpointError, match=f"{shard_path}: its safetensors header is not valid JSON"):
        read_config(path)


def _overflowing_logits(tensors: dict) -> None:
    """Finite weights whose float16 logits overflow: the final norm scales by 60000, lm_head sums every dim."""
    tensors["model.norm.weight"][:] = 60000.0
    tensors["lm_head.weight"][:] = 1.0


def test_nonfinite_logits_fail_the_request_with_an_error_and_a_metric(good: str, tmp_path) -> None:  # noqa: ANN001
    """Non-finite logits at run time end that request with an error (HTTP 500, or an error event when streamed)
    and count in deep_ep_npu:nonfinite_logits_total, instead of a stream of token 0."""
    path, _ = _copy(good, tmp_path, _overflowing_logits)
    config = build_config(
        {
            "model": path,
            "ep-size": 1,
            "dtype": "float16",
            "max-model-len": 64,
            "served-model-name": "overflow",
            "log-level": "warning",
        }
    )
    with UvicornThread(create_app(config, build_engine(config))) as srv:
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 500 and "non-finite logits (NaN or Inf)" in r.json()["error"]["message"], r.text
        r = httpx.post(srv.url + "/v1/completions", json={**body, "stream": True}, timeout=60)
        events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
        assert "non-finite logits" in events[-1]["error"]["message"], r.text
        metrics = httpx.get(srv.url + "/metrics").text
    assert 'deep_ep_npu:nonfinite_logits_total{model_name="overflow"} 2.0' in metrics


def test_weight_that_overflows_the_dtype_is_refused(good: str, tmp_path) -> None:  # noqa: ANN001
    path, _ = _copy(good, tmp_path, lambda t: t[ATTN].__setitem__((0, 0), 1e5))
    with pytest.raises(CheckpointError, match=f"'{ATTN}' overflows torch.float16 .*--dtype bfloat16 or float32"):
        load_model(path, lambda cfg: LocalComm(cfg.num_experts, 8), dtype="float16")
    load_model(path, lambda cfg: LocalComm(cfg.num_experts, 8), dtype="bfloat16")


def test_tensors_the_model_does_not_read_are_named_in_a_warning(good: str, tmp_path, caplog) -> None:  # noqa: ANN001
    """A bias the config does not declare is reported; MTP layers past num_hidden_layers and scales are not."""
    extra = {
        "model.layers.0.self_attn.q_proj.bias": torch.zeros(64),
        "model.layers.2.mlp.gate.weight": torch.zeros(8, 64),
        "model.layers.0.self_attn.q_proj.weight_scale_inv": torch.ones(1),
    }
    path, _ = _copy(good, tmp_path, lambda t: t.update(extra))
    with caplog.at_level("WARNING", logger="server.loader"):
        read_config(path)
    assert "1 tensor(s) that the model does not read" in caplog.text
    assert "model.layers.0.self_attn.q_proj.bias" in caplog.text


def test_a_tokenizer_without_tokenizer_json_is_refused(good: str, tmp_path) -> None:  # noqa: ANN001
    """Byte-level ids would be meaningless to a model that ships its own tokenizer in another form."""
    from server.tokenizer import ByteTokenizer, load_tokenizer

    path = str(tmp_path / "ckpt")
    shutil.copytree(good, path)
    assert isinstance(load_tokenizer(path, [255]), ByteTokenizer)  # ships none: the documented byte-level one
    with open(os.path.join(path, "tiktoken.model"), "w") as f:
        f.write("")
    with pytest.raises(ValueError, match=r"ships a tokenizer as \['tiktoken.model'\] but no tokenizer.json"):
        load_tokenizer(path, [255])
