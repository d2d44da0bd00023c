"""The server's configuration: one pydantic model, filled from defaults < YAML file < command line.

YAML keys are the long command-line option names (``max-num-seqs: 8``; ``max_num_seqs`` is accepted too). Unknown
keys and bad values fail at start-up with a :class:`ConfigError` naming the key, the value and what is allowed.
The option names (``docs/serving.md`` lists them) are a public contract; keep them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A bad configuration value or key; the message names the key."""


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)(i?B)?\s*$")


def parse_bytes(value: Any) -> Any:
    """A byte count: an int, or a number with a unit as vLLM reads them (``1k`` = 1000, ``1K`` = 1024; ``4G`` =
    4 GiB, ``4g`` = 4e9; ``4GiB`` = 4 GiB, ``4GB`` = 4e9). None and other types pass through (for validation)."""
    if not isinstance(value, str):
        return value
    match = _BYTES.match(value)
    if match is None:
        raise ValueError(f"expected a byte count such as 4294967296, '4G' or '4GiB', got {value!r}")
    number, unit, suffix = match.groups()
    unit = unit.upper() if suffix == "iB" else unit.lower() if suffix == "B" else unit
    return int(float(number) * _UNITS[unit])


ByteCount = Annotated[int, BeforeValidator(parse_bytes)]


class ServerConfig(BaseModel):
    """Everything ``python -m server`` takes. Field ``foo_bar`` is option ``--foo-bar`` and YAML key ``foo-bar``."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model: str | None = Field(
        None, description="HF checkpoint directory (config.json + safetensors) (default: none, the random model)"
    )
    host: str = Field("127.0.0.1", description="address to bind the HTTP server to")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0 = any free port)")
    ep_size: int = Field(2, ge=1, le=1024, description="number of expert-parallel decode workers")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="model dtype")
    device: Literal["cpu", "cuda", "npu"] = Field(
        "cpu", description="device of each worker's model, KV cache, sampler and MoE buffers (worker i: device i)"
    )
    backend: Literal["auto", "reference", "ascend"] = Field("auto", description="deep_ep_npu Buffer backend")
    dist_backend: Literal["gloo", "nccl", "hccl"] = Field(
        "gloo", description="torch.distributed backend of the workers' EP group (control messages use gloo)"
    )
    socket_ifname: str | None = Field(
        None,
        min_length=1,
        pattern=r"^[A-Za-z0-9_.:@^,=-]+$",
        description="network interface(s) the torchrun ranks' process groups use between hosts (sets "
        "GLOO_SOCKET_IFNAME, HCCL_SOCKET_IFNAME and NCCL_SOCKET_IFNAME in each rank; default: those variables as "
        "set, else each library's own pick)",
    )
    simulate_npu: bool = Field(
        False,
        description="install the NPU stand-in deep_ep_npu.sim in every worker: "
        "backend ascend runs on CPU (device npu / dist-backend hccl run as cpu / gloo)",
    )
    max_num_seqs: int = Field(16, ge=1, le=4096, description="running requests per DP rank (worker)")
    max_model_len: int = Field(512, ge=2, le=1 << 20, description="prompt + output tokens per request")
    max_num_batched_tokens: int | None = Field(
        None,
        ge=1,
        description="tokens per worker per step (decodes + prefill chunks; the MoE Buffers' "
        "num_max_dispatch_tokens_per_rank) (default: max(max-num-seqs, 64))",
    )
    block_size: int = Field(16, ge=1, le=4096, description="tokens per KV-cache block")
    kv_cache_memory: ByteCount | None = Field(
        None,
        ge=1,
        description="bytes of KV cache per worker, e.g. 4G (= 4 GiB) or 4294967296; overrides "
        "gpu-memory-utilization (default: none)",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="with no kv-cache-memory: the fraction of a worker's device memory its weights, "
        "activations and KV cache may use (cpu: of the host memory available, split over the workers and capped at "
        "max-num-seqs full-length requests)",
    )
    enable_prefix_caching: bool = Field(
        True, description="reuse the KV cache of full blocks of a previous request's prefix"
    )
    async_scheduling: bool = Field(True, description="plan step k+1 while the workers run step k (spawned workers)")
    two_batch_overlap: bool = Field(
        False,
        description="EP > 1: run steps of at least 16 tokens (over all workers) as two micro-batches, one's MoE "
        "dispatch / combine in flight while the other's attention runs (docs/decode-runtime.md)",
    )
    worker_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads per worker (default: the CPUs available split over the local workers, "
        "and one for a CPU worker's steps of at most 64 tokens)",
    )
    api_key: str | None = Field(None, min_length=1, description="require 'Authorization: Bearer <key>' on /v1/*")
    served_model_name: str | None = Field(
        None,
        min_length=1,
        description="model id in the API (default: the checkpoint directory's name, or random-qwen3-moe)",
    )
    seed: int = Field(0, ge=0, description="seed of the random model (when --model is absent)")
    random_model: dict[str, Any] = Field(
        default_factory=dict,
        description="overrides of the random model's shape: key=value,... or JSON, e.g. hidden_size=64,num_experts=8",
    )
    max_queue_len: int = Field(256, ge=0, description="requests allowed to wait beyond capacity; more get 503")
    max_request_bytes: int = Field(1 << 20, ge=1024, description="largest accepted HTTP request body (bytes)")
    max_tokens_limit: int | None = Field(None, ge=1, description="cap on a request's max_tokens")
    max_prompt_tokens: int | None = Field(None, ge=1, description="cap on a request's prompt tokens")
    api_key_health: bool = Field(False, description="with api-key: /health needs the key too (off: /health is open)")
    api_key_metrics: bool = Field(False, description="with api-key: /metrics and /version need the key too")
    step_timeout_s: float = Field(
        30.0,
        gt=0,
        le=86400,
        description="a worker step (or health ping) slower than "
        "this marks the engine failed: /health 503, requests 503",
    )
    elastic: bool = Field(
        False,
        description="keep serving on the surviving workers when one dies or hangs (its "
        "requests fail; its experts are dropped unless replicas live elsewhere, see "
        "--num-redundant-experts; logged, metrics ep_ranks_lost, experts_lost)",
    )
    num_redundant_experts: int = Field(
        0,
        ge=0,
        description="extra expert slots per MoE layer (E + R must divide by "
        "ep-size; slot E + i starts as expert i mod E; see --eplb)",
    )
    expert_placement: str | None = Field(
        None,
        min_length=1,
        description="static expert placement: a JSON file in "
        "vllm-ascend's format (layer_list / device_list / device_expert)",
    )
    eplb: bool = Field(
        False,
        description="expert-parallel load balancing: measure expert load, recompute the "
        "placement (DeepSeek's EPLB) every --eplb-interval steps, move expert weights while "
        "serving",
    )
    eplb_interval: int = Field(1000, ge=1, description="steps between EPLB rebalances")
    eplb_window: int = Field(1000, ge=1, description="steps of expert load EPLB balances over (a sliding window)")
    chat_template: str | None = Field(
        None,
        min_length=1,
        description="chat template for /v1/chat/completions: a Jinja file, or the template "
        "itself (a value holding '{', '}' or a newline); replaces the checkpoint's (default: the checkpoint's)",
    )
    generation_config: Literal["auto", "vllm"] = Field(
        "auto",
        description="sampling defaults: 'auto' takes the checkpoint's generation_config.json values "
        "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) as vLLM does; 'vllm' ignores them",
    )
    enable_auto_tool_choice: bool = Field(
        False,
        description="serve tool_choice 'auto' (the default when a request "
        "has tools): the model's own tool-call syntax is parsed by "
        "--tool-call-parser",
    )
    tool_call_parser: Literal["hermes", "deepseek_v3", "glm45", "openai"] | None = Field(
        None,
        description="how tool_choice 'auto' reads tool calls from the output: hermes (Qwen2.5 / Qwen3 "
        "<tool_call> JSON), deepseek_v3, glm45, openai (gpt-oss harmony)",
    )
    int8_experts: bool = Field(
        False,
        description="routed experts in int8 (per-channel weights, per-token dynamic "
        "int8 activations: W8A8); W8A8 checkpoints keep their int8 values",
    )
    moe_impl: Literal["unfused", "fused"] = Field(
        "unfused", description="MoE layers: dispatch -> experts -> combine, or the fused pipelined Buffer.mega_moe"
    )
    disable_docs: bool = Field(
        False, description="turn off /openapi.json and /docs (on by default; behind api-key when one is set)"
    )
    disaggregation_mode: Literal["none", "prefill", "decode"] = Field(
        "none",
        description="prefill/decode disaggregation: 'prefill' computes prompts and first tokens and hands "
        "their KV cache to decode instances; 'decode' receives it and decodes; 'none' colocates both (put "
        "python -m server.router in front of the two kinds)",
    )
    disaggregation_transfer_backend: Literal["mooncake"] = Field(
        "mooncake", description="what moves the KV cache between instances: Mooncake's Transfer Engine"
    )
    disaggregation_bootstrap_port: int = Field(
        8998,
        ge=0,
        le=65535,
        description="a prefill instance's bootstrap port, where decode instances learn where "
        "a request's KV blocks are (0 = any free port)",
    )
    disaggregation_timeout_s: float = Field(
        60.0,
        gt=0,
        le=86400,
        description="how long a prefill instance holds a request's KV blocks for its decode "
        "instance (and a decode instance waits for its prefill instance) before giving up",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field("info", description="uvicorn log level")

    @field_validator("chat_template")
    @classmethod
    def _check_chat_template(cls, value: str | None) -> str | None:
        """Readable (a file) and valid Jinja, so a bad template stops start-up, not the first chat request."""
        if value is not None:
            from server.chat_template import ChatTemplate, read_override

            ChatTemplate(read_override(value), "the template")
        return value

    @model_validator(mode="after")
    def _check_names(self) -> ServerConfig:
        if self.model is not None and not os.path.isdir(self.model):
            raise ValueError(f"model: {self.model!r} is not a directory (give a HF checkpoint dir or omit it)")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable-auto-tool-choice: needs --tool-call-parser (hermes, deepseek_v3, glm45, openai)")
        if self.int8_experts and self.moe_impl == "fused":
            raise ValueError("int8-experts: the fused MoE (moe-impl fused) runs float expert weights; use one")
        if self.simulate_npu and (self.device == "cuda" or self.dist_backend == "nccl"):
            raise ValueError(
                f"simulate-npu: the stand-in runs on CPU tensors over gloo; got device {self.device!r}, dist-backend "
                f"{self.dist_backend!r} (allowed with simulate-npu: device cpu or npu, dist-backend gloo or hccl; "
                "npu and hccl then run as cpu and gloo)"
            )
        return self

    @property
    def transfer_host(self) -> str:
        """The address the KV transfer engines and the bootstrap server bind: ``host``, or loopback when ``host``
        is a wildcard (bind ``--host`` to the node's address on a cluster)."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host

    @property
    def model_name(self) -> str:
        """The model id clients send and ``/v1/models`` lists."""
        if self.served_model_name:
            return self.served_model_name
        if self.model:
            return os.path.basename(os.path.normpath(self.model))
        return "random-qwen3-moe"


def option_name(field: str) -> str:
    """``max_num_seqs`` -> ``max-num-seqs`` (the CLI option without ``--`` and the YAML key)."""
    return field.replace("_", "-")


def _field_name(key: str) -> str:
    return key.replace("-", "_")


def _format_error(err: ValidationError, sources: Mapping[str, str]) -> str:
    lines = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        key = option_name(loc[0]) if loc else "config"
        where = sources.get(loc[0], "default") if loc else "config"
        # a model-level check's input is the whole config (api-key included): its message names the values itself
        value = f" (got {e['input']!r})" if loc and "input" in e and e["type"] != "extra_forbidden" else ""
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = f"unknown key; allowed keys: {', '.join(option_name(f) for f in ServerConfig.model_fields)}"
        lines.append(f"{key}: {msg}{value} [from {where}]")
    return "invalid server config:\n  " + "\n  ".join(lines)


API_KEY_ENV = "DEEP_EP_NPU_API_KEY"  # the API key from the environment (below YAML and the command line)


def env_values(environ: Mapping[str, str]) -> dict[str, Any]:
    """The options the environment can set: ``api-key`` from ``DEEP_EP_NPU_API_KEY`` (keeps it off the command
    line, where other local users can read it in the process list)."""
    return {"api-key": environ[API_KEY_ENV]} if environ.get(API_KEY_ENV) else {}


def build_config(
    yaml_values: Mapping[str, Any] | None = None,
    cli_values: Mapping[str, Any] | None = None,
    yaml_path: str | None = None,
    env: Mapping[str, Any] | None = None,
) -> ServerConfig:
    """Merge defaults < ``env`` (:func:`env_values`) < ``yaml_values`` < ``cli_values`` (all keyed by option names)
    and validate.

    Raises :class:`ConfigError` naming each bad or unknown key and where it came from.
    """
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    layers = ((env or {}, "environment"), (yaml_values or {}, yaml_path or "yaml"), (cli_values or {}, "command line"))
    for values, where in layers:
        for key, value in values.items():
            if not isinstance(key, str):
                raise ConfigError(f"config key {key!r} [from {where}] must be a string option name")
            merged[_field_name(key)] = value
            sources[_field_name(key)] = where
    try:
        return ServerConfig(**merged)
    except ValidationError as e:
        raise ConfigError(_format_error(e, sources)) from None


def load_yaml(path: str) -> dict[str, Any]:
    """Read a YAML config file: a mapping of option names to values (empty file = no values)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"config: cannot read {path!r}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config: {path!r} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path!r} must hold a mapping of option names, got {type(data).__name__}")
    return data
