"""``python -m server --config configs/<name>.yaml [--option value ...]``: parse, validate, build the engine, serve.

Every :class:`~server.config.ServerConfig` field is a long option (``--max-num-seqs 8``); dict-valued options take
``key=value,...`` or JSON (``--random-model hidden_size=128`` or ``--random-model '{"hidden_size": 128}'``); a
boolean option is a switch (``--elastic`` / ``--no-elastic``).
Precedence: command line > YAML file > defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import typing
from collections.abc import Sequence
from typing import Any

from server.config import ConfigError, ServerConfig, build_config, env_values, load_yaml, option_name


def _is_dict_field(name: str) -> bool:
    annotation = ServerConfig.model_fields[name].annotation
    return annotation is dict or typing.get_origin(annotation) is dict


def _shown(default: Any) -> str:
    if default is None:
        return "none"
    if isinstance(default, bool):
        return "on" if default else "off"
    return json.dumps(default) if isinstance(default, dict) else str(default)


def parse_mapping(option: str, text: str) -> dict[str, Any]:
    """A dict option's value: a JSON object (``{"hidden_size": 64}``) or ``key=value,...`` (``hidden_size=64,
    num_experts=8``; each value read as JSON when it is a number, bool or null, else kept as a string)."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{option}: expected a JSON object or key=value,..., got {text!r} ({e})") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{option}: expected a JSON object, got {text!r}")
        return value
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{option}: expected key=value,... or a JSON object, got {item!r} in {text!r}")
        try:
            out[key.strip()] = json.loads(raw.strip())
        except json.JSONDecodeError:
            out[key.strip()] = raw.strip()
    return out


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m server",
        description="Serve a MoE model expert-parallel behind an OpenAI-compatible HTTP API.",
    )
    parser.add_argument("--config", help="YAML file keyed by the long option names below")
    for name, field in ServerConfig.model_fields.items():
        default = field.get_default(call_default_factory=True)
        help_text = field.description or ""
        if "(default:" not in help_text:  # a description that names its default says it once itself
            help_text += f" (default: {_shown(default)})"
        option = f"--{option_name(name)}"
        if field.annotation is bool:  # a switch: --elastic / --no-elastic
            parser.add_argument(
                option, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text
            )
        else:
            parser.add_argument(option, default=argparse.SUPPRESS, metavar=name.upper(), help=help_text)
    return parser


def parse_config(argv: Sequence[str] | None = None) -> ServerConfig:
    """The validated config from ``argv`` (default ``sys.argv[1:]``); raises :class:`ConfigError`."""
    args = vars(make_parser().parse_args(argv))
    path = args.pop("config", None)
    yaml_values = load_yaml(path) if path else {}
    cli_values: dict[str, Any] = {}
    for name, value in args.items():
        cli_values[name] = parse_mapping(option_name(name), value) if _is_dict_field(name) else value
    return build_config(yaml_values, cli_values, yaml_path=path, env=env_values(os.environ))


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = parse_config(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from server.api.serve import leave_torchrun_rank, serve, torchrun_rank

    try:
        code = serve(config)
    except KeyboardInterrupt:  # Ctrl-C: uvicorn has shut down gracefully, serve() has stopped the workers
        code = 0
    except SystemExit as e:  # SIGTERM, likewise
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    if torchrun_rank() is not None:
        leave_torchrun_rank(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
