"""``python -m server --config configs/<name>.yaml [--option value ...]``: parse, validate, build the engine, serve.

Every :class:`~server.config.ServerConfig` field is a long option (``--max-num-seqs 8``); dict-valued options take
JSON (``--random-model '{"hidden_size": 128}'``); a boolean option alone means true (``--simulate-npu``).
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


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m server",
        description="Serve a MoE model expert-parallel behind an OpenAI-compatible HTTP API.",
    )
    parser.add_argument("--config", help="YAML file keyed by the long option names below")
    for name, field in ServerConfig.model_fields.items():
        default = field.get_default(call_default_factory=True)
        # a boolean option alone means true (``--simulate-npu``); ``--simulate-npu false`` still parses
        flag = {"nargs": "?", "const": "true"} if field.annotation is bool else {}
        parser.add_argument(
            f"--{option_name(name)}", default=argparse.SUPPRESS, metavar=name.upper(),
            help=f"{field.description} (default: {default!r})", **flag,
        )  # fmt: skip
    return parser


def parse_config(argv: Sequence[str] | None = None) -> ServerConfig:
    """The validated config from ``argv`` (default ``sys.argv[1:]``); raises :class:`ConfigError`."""
    args = vars(make_parser().parse_args(argv))
    path = args.pop("config", None)
    yaml_values = load_yaml(path) if path else {}
    cli_values: dict[str, Any] = {}
    for name, value in args.items():
        if _is_dict_field(name):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{option_name(name)}: expected a JSON object, got {value!r} ({e})") from None
        cli_values[name] = value
    return build_config(yaml_values, cli_values, yaml_path=path, env=env_values(os.environ))


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = parse_config(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from server.api.serve import serve

    try:
        return serve(config)
    except KeyboardInterrupt:  # Ctrl-C: uvicorn has shut down gracefully, serve() has stopped the workers
        return 0


if __name__ == "__main__":
    sys.exit(main())
