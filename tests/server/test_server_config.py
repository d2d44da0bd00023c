"""Server config: defaults < YAML < CLI, strict validation naming the key, the shipped configs parse."""

from __future__ import annotations

import glob
import os

import pytest

from server.cli import make_parser, parse_config
from server.config import ConfigError, ServerConfig, build_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_are_safe():
    c = parse_config([])
    assert c.host == "127.0.0.1" and c.port == 8000 and c.ep_size == 2 and c.api_key is None
    assert c.model is None and c.model_name == "random-qwen3-moe"


def test_precedence_cli_over_yaml_over_defaults(tmp_path):
    path = _write(tmp_path, "port: 9001\nmax-num-seqs: 3\nmax_model_len: 64\nserved-model-name: from-yaml\n")
    c = parse_config(["--config", path, "--port", "9002", "--served-model-name", "from-cli"])
    assert (c.port, c.max_num_seqs, c.max_model_len, c.model_name) == (9002, 3, 64, "from-cli")
    assert c.dtype == ServerConfig.model_fields["dtype"].default  # untouched key keeps the default


def test_contract_option_names_exist():
    options = {a for action in make_parser()._actions for a in action.option_strings}
    for name in (
        "--config",
        "--model",
        "--host",
        "--port",
        "--ep-size",
        "--dtype",
        "--backend",
        "--max-num-seqs",
        "--max-model-len",
        "--api-key",
        "--served-model-name",
    ):
        assert name in options


def test_dict_option_from_yaml_and_json_cli(tmp_path):
    path = _write(tmp_path, "random-model:\n  hidden_size: 32\n")
    assert parse_config(["--config", path]).random_model == {"hidden_size": 32}
    assert parse_config(["--config", path, "--random-model", '{"num_layers": 1}']).random_model == {"num_layers": 1}
    with pytest.raises(ConfigError, match="random-model: expected a JSON object"):
        parse_config(["--random-model", "{oops"])


def test_dict_option_as_key_value_pairs():
    c = parse_config(["--random-model", "hidden_size=64, num_experts=8,architecture=mixtral,norm_topk_prob=true"])
    assert c.random_model == {"hidden_size": 64, "num_experts": 8, "architecture": "mixtral", "norm_topk_prob": True}
    with pytest.raises(ConfigError, match="random-model: expected key=value,... or a JSON object, got 'oops'"):
        parse_config(["--random-model", "hidden_size=64,oops"])


def test_boolean_options_are_switches():
    assert parse_config(["--elastic"]).elastic is True
    assert parse_config(["--elastic", "--no-elastic"]).elastic is False
    assert parse_config(["--simulate-npu", "--disable-docs"]).disable_docs is True
    with pytest.raises(SystemExit):  # a switch takes no value
        parse_config(["--elastic", "yes"])


def test_help_prints_each_default_once(capsys):
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--elastic, --no-elastic" in text and "hidden_size=64,num_experts=8" in text
    for option in make_parser()._actions[2:]:  # after --help and --config
        assert option.help.count("(default:") == 1, option.help


@pytest.mark.parametrize(
    ("yaml_text", "argv", "needle"),
    [
        ("max-num-seq: 4\n", [], "max-num-seq: unknown key"),
        ("port: 70000\n", [], "port: Input should be less than or equal to 65535 (got 70000)"),
        ("dtype: float64\n", [], "dtype: Input should be 'float32', 'bfloat16' or 'float16'"),
        ("", ["--ep-size", "zero"], "ep-size: Input should be a valid integer"),
        ("", ["--backend", "cuda"], "backend: Input should be 'auto', 'reference' or 'ascend'"),
        ("", ["--model", "/nonexistent/ckpt"], "model: '/nonexistent/ckpt' is not a directory"),
        ("- port\n", [], "must hold a mapping"),
        ("port: [1\n", [], "is not valid YAML"),
    ],
)
def test_bad_config_names_the_key(tmp_path, yaml_text, argv, needle):
    path = _write(tmp_path, yaml_text)
    with pytest.raises(ConfigError) as e:
        parse_config(["--config", path, *argv])
    assert needle in str(e.value)


def test_error_says_where_the_value_came_from(tmp_path):
    path = _write(tmp_path, "max-model-len: 1\n")
    with pytest.raises(ConfigError, match=r"max-model-len: .* \[from .*c\.yaml\]"):
        parse_config(["--config", path])
    with pytest.raises(ConfigError, match=r"max-model-len: .* \[from command line\]"):
        parse_config(["--config", path, "--max-model-len", "0"])


def test_missing_config_file():
    with pytest.raises(ConfigError, match="cannot read"):
        parse_config(["--config", "/nonexistent.yaml"])


def test_unknown_cli_option_exits():
    with pytest.raises(SystemExit):
        parse_config(["--no-such-option", "1"])


def test_cli_main_reports_config_error(capsys):
    from server.cli import main

    assert main(["--port", "-1"]) == 2
    assert "port: Input should be greater than or equal to 0" in capsys.readouterr().err


def test_cli_main_reports_engine_refusal(capsys, tmp_path):
    from server.cli import main

    assert main(["--ep-size", "3"]) == 2  # the default random model has 8 experts
    assert "ep_size=3 must divide the model's num_experts=8" in capsys.readouterr().err
    assert main(["--model", str(tmp_path)]) == 2  # a directory without config.json
    assert "has no config.json" in capsys.readouterr().err


def test_config_is_frozen():
    c = build_config()
    with pytest.raises(Exception, match="frozen"):
        c.port = 1  # type: ignore[misc]


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))))
def test_shipped_configs_parse(path):
    from server.config import load_yaml

    values = load_yaml(path)
    values.pop("model", None)  # example checkpoint paths need not exist here
    c = build_config(values, yaml_path=path)
    assert c.host == "127.0.0.1"  # every shipped config binds loopback only
    if c.model is None:  # the random model's spec is one the runtime accepts
        from server.loader import random_hf_config
        from server.models.config import ModelConfig

        cfg = ModelConfig.from_hf(random_hf_config(c.random_model))
        assert cfg.num_experts % c.ep_size == 0
