"""glm53's settings: one typed Struct, one entry per setting.

Each field of `Settings` is a setting. Its CLI flag (`--field-name`, plus any alias) and its
environment twin (`GLM53_FIELD_NAME`, or the seed's spelling where one exists) are derived from
the field, and its description, group and aliases live in the field's `Meta`. A value comes from
the flag if given, else from the environment, else from the default; `resolve` records which.
This is the only module that reads the environment. It imports only glm53.errors and glm53.modes
(the tier modes and the table of which engine serves which).

To add a setting: add one annotated field below. The CLI, the environment, /server_info and
docs/reference.md (`reference_markdown()`) pick it up from there.
"""

from __future__ import annotations

import argparse
import enum
import os
import re
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from glm53.errors import Glm53Error
from glm53.modes import Mode


class ConfigurationError(ValueError, Glm53Error):
    """A setting has a value glm53 cannot use; the message names the flag, the variable and the fix."""


def _s(
    description: str, *, group: str, flags: tuple[str, ...] = (), env: str = "", **extra
) -> Meta:
    return Meta(
        description=description, extra={"group": group, "flags": flags, "env": env, **extra}
    )


NonNegInt = Annotated[int, Meta(ge=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0)]
PosInt = Annotated[int, Meta(ge=1)]
EngineKind = Literal["auto", "cpu", "gpu", "scripted"]
LogLevel = Literal["debug", "info", "warning", "error"]
LanePrecision = Literal["auto", "exact", "fast"]
PrefillOrder = Literal["chunk", "layer-major"]
NvmePrefetch = Literal["off", "next-layer"]  # glm53.tiers.decode_prefetch.MODES


class Settings(msgspec.Struct, kw_only=True, frozen=True):
    """Every effective setting of a glm53 process. Build it with `resolve`."""

    # --- model and engine ---------------------------------------------------------------------
    model: Annotated[
        str | None,
        _s(
            "Checkpoint directory (glm5_next EXL3). Without it glm53 serves the synthetic demo "
            "checkpoint, generated on first use into --cache-dir.",
            group="model",
        ),
    ] = None
    demo: Annotated[
        bool,
        _s(
            "Serve the synthetic demo checkpoint on the CPU engine (random weights: the text it "
            "writes is gibberish; everything around it is the real product).",
            group="model",
        ),
    ] = False
    engine: Annotated[
        EngineKind,
        _s(
            "Engine: gpu (exllamav3), cpu (transformers + the tiers), scripted (replays a script "
            "file, for tests and benchmarks: not a model), or auto (gpu when CUDA is present and "
            "a real checkpoint is given, else cpu).",
            group="model",
        ),
    ] = "auto"
    script: Annotated[
        str | None,
        _s(
            "Script file (JSON) the scripted engine replays; see glm53/engine/scripted.py.",
            group="model",
        ),
    ] = None
    mode: Annotated[
        Mode,
        _s(
            "Tier mode: exact (VRAM cache + zero-copy RAM, bit-identical), fast (+ CPU lane), nvme "
            "(NVMe store -> RAM tier -> VRAM, + CPU lane), nvme-exact, or auto (planned from the host).",
            group="model",
        ),
    ] = "auto"
    cache_dir: Annotated[
        str | None,
        _s(
            "Directory for generated files (the demo checkpoint); default $XDG_CACHE_HOME/glm53 or "
            "~/.cache/glm53.",
            group="model",
        ),
    ] = None
    context: Annotated[
        int,
        Meta(ge=16),
        _s(
            "Context length in tokens (prompt + answer), capped by the checkpoint's own limit.",
            group="model",
            flags=("-cs",),
        ),
    ] = 131072
    # --- scheduling ---------------------------------------------------------------------------
    max_batch: Annotated[
        int,
        Meta(ge=1, le=1024),
        _s(
            "Streams decoded together in one step (GLM's recurrent KDA state needs one slot per stream).",
            group="scheduling",
        ),
    ] = 4
    chunk_size: Annotated[
        int,
        Meta(ge=16),
        _s(
            "Prefill chunk in tokens: prompt tokens processed per step, over all streams.",
            group="scheduling",
        ),
    ] = 2048
    prefill: Annotated[
        PrefillOrder,
        _s(
            "Prefill order for prompts longer than one chunk: chunk (each chunk through every "
            "layer, exllamav3's Generator) or layer-major (every chunk through a layer before "
            "the next: each touched expert crosses PCIe once per layer per prompt, same output). "
            "GPU engine, one GPU, in exact, nvme-exact and nvme mode, without "
            "--allow-unrun-modes. In exact mode layer-major passed its 6 GPU tests on an H200 "
            "(2026-12-05); in nvme-exact and nvme mode (the store read once per layer per "
            "prompt: the chunks of a layer resolve their picks in the RAM tier one after "
            "another, read zero-copy, unstaged) its GPU test passed in nvme-exact at RAM 40 % on "
            "an H100 (2026-12-05).",
            group="scheduling",
        ),
    ] = "chunk"
    queue_limit: Annotated[
        int,
        Meta(ge=0),
        _s(
            "Requests that may wait for a free stream slot; beyond it requests get 429 with Retry-After.",
            group="scheduling",
        ),
    ] = 64
    prefix_cache_gb: Annotated[
        float,
        Meta(ge=0),
        _s(
            "RAM (GiB) for prefix-cache snapshots on the CPU engine: a prompt that starts with an "
            "earlier prompt's first chunks (multiples of --chunk-size) resumes from that state "
            "instead of recomputing it, with the same output; least recently used evicted "
            "first; 0 turns it off. The GPU engine reuses prefixes inside exllamav3's Generator.",
            group="scheduling",
        ),
    ] = 2.0
    # --- tiers --------------------------------------------------------------------------------
    ram_cap: Annotated[
        NonNegInt | None,
        _s(
            "Cap of the RAM expert tier, in bytes (accepts 512M, 8G, 1.5GiB); default: what "
            "MemAvailable and the cgroup's memory.max leave after the model, less a margin. At "
            "least one decode step's experts (top-k x --max-batch of a layer).",
            group="tiers",
            kind="size",
        ),
    ] = None
    store: Annotated[
        str | None,
        _s("NVMe expert store (made by `glm53 store pack`), read with O_DIRECT.", group="tiers"),
    ] = None
    read_timeout: Annotated[
        NonNegFloat,
        _s(
            "Seconds one batch of expert reads (store or shards, O_DIRECT) may take before the "
            "request that needs it fails with a 500 naming the layer and expert: a hung disk or "
            "a dead network mount never hangs the server; 0 waits as long as a read takes.",
            group="tiers",
        ),
    ] = 30.0
    nvme_prefetch: Annotated[
        NvmePrefetch,
        _s(
            "Decode prefetch in --mode nvme-exact and nvme (GPU engine): next-layer runs each "
            "MoE layer's router for the next layer on this layer's input and reads the "
            "predicted experts the RAM tier lacks from the store while this layer computes (a "
            "hint: the output is unchanged). Its GPU tests passed (H100, 2026-12-05: "
            "torch.equal to stock exllamav3 at RAM 40 % and 70 %, alone and at batch 4, with "
            "prefill staging from the store on); served without --allow-unrun-modes, off by "
            "default until it is benchmarked.",
            group="tiers",
        ),
    ] = "off"
    cpus: Annotated[
        str | None,
        _s(
            "CPUs of the CPU lane, as a list like 2-23 or 0,2,4; default: one per physical core, "
            "leaving cores for the OS and the controller.",
            group="tiers",
            env="GLM53_CT_CPUS",
        ),
    ] = None
    cpu_threads: Annotated[
        PosInt | None,
        _s(
            "Threads of the CPU lane; default: the number of --cpus.",
            group="tiers",
            env="GLM53_CT_THREADS",
        ),
    ] = None
    ct_precision: Annotated[
        LanePrecision,
        _s(
            "Arithmetic of the CPU lane: exact (fp16 weights bit-identical to exllamav3's, fp32 "
            "products), fast (unrounded codebook, int16 inputs: about twice the speed, an error "
            "within the GPU kernel's own), or auto: fast in the GPU engine's fast and nvme "
            "modes, exact elsewhere (the CPU engine stays exact, to match transformers).",
            group="tiers",
            env="GLM53_CT_PRECISION",
        ),
    ] = "auto"
    ct_b: Annotated[
        PosFloat | None,
        _s(
            "Fast mode (GPU engine, --mode fast): pin the router's estimate of the CPU lane's "
            "milliseconds per expert at one row (the seed's figure: 0.104 at 22 threads); "
            "default: the router's moving estimate of what the lane measures. Refused in other "
            "modes, where it would do nothing.",
            group="tiers",
            env="GLM53_CT_B",
        ),
    ] = None
    ct_swz: Annotated[
        bool,
        _s(
            "Fast mode: keep a second, block-contiguous (swizzled) copy of the experts for the "
            "CPU lane. Off: it doubles the experts' RAM, and glm53's lane streams whole tile "
            "rows in place without it (on the H200 host's 16 AVX-512 vCPUs at 14 threads, the "
            "swizzled layout bought exllamav3's own CPU kernel 6 %, 0.284 to 0.268 ms an expert, "
            "and the in-place lane ran at 0.276). Not in this build: refused when set.",
            group="tiers",
            env="GLM53_CT_SWZ",
        ),
    ] = False
    vram_budget: Annotated[
        NonNegInt | None,
        _s(
            "VRAM glm53 may use, in bytes (accepts 24G, 23.5GiB): the expert cache, staging "
            "buffers and KV cache are planned within it as on a card with that much free (a "
            "desktop sharing the GPU, or a small card emulated on a large one); default: the "
            "free VRAM.",
            group="tiers",
            kind="size",
        ),
    ] = None
    gpus: Annotated[
        tuple[NonNegInt, ...] | None,
        _s(
            "GPU engine: the GPUs (CUDA indices) to split the model's layers over, in layer "
            "order, e.g. 0,1: each holds a contiguous range of layers and an expert cache of its "
            "own over its MoE layers, all reading misses from the one pinned RAM home. A GPU "
            "listed twice (0,0) runs the split with both halves on that GPU. Default: GPU 0 "
            "alone. The split has run only as 0,0 on one GPU (its GPU tests passed on an H200 "
            "and an H100, 2026-12-05), never over two distinct devices: entries that are all "
            "one GPU are served without --allow-unrun-modes, two or more distinct GPUs need it "
            "(docs/multi-gpu.md).",
            group="tiers",
            kind="int_list",
        ),
    ] = None
    ec_max_slots: Annotated[
        NonNegInt | None,
        _s("Most VRAM expert slots; default: as many as the VRAM budget allows.", group="tiers"),
    ] = None
    ec_reserve_gb: Annotated[
        float,
        Meta(ge=0),
        _s(
            "VRAM (GiB) kept free for activations and CUDA after the expert cache is sized.",
            group="tiers",
        ),
    ] = 1.0
    ec_elastic_gb: Annotated[
        float,
        Meta(ge=0),
        _s(
            "VRAM (GiB) of the expert cache lent to prefill and taken back after it. Not in this "
            "build (prefill stages through --ec-stage-gb): refused when changed.",
            group="tiers",
        ),
    ] = 10.0
    ec_stage_gb: Annotated[
        NonNegFloat | None,
        _s(
            "VRAM (GiB) of the two prefill staging buffers; default: two whole MoE layers when "
            "they take at most a quarter of the VRAM left after the model, else that quarter. "
            "0 turns staging off. In nvme-exact and nvme each staged layer's misses are read "
            "from the store ahead, with the same default (its GPU tests passed on an H100, "
            "2026-12-05: in-process and served at RAM 40 % and 70 %, the store's read faults).",
            group="tiers",
        ),
    ] = None
    ec_stage_loan: Annotated[
        bool,
        _s(
            "Exact and fast modes: lend the two prefill staging buffers (--ec-stage-gb) to the "
            "expert cache between prefills, so decode has their VRAM as cache slots; a prefill "
            "chunk takes them back (one device sync a prompt). Output unchanged (torch.equal "
            "to stock exllamav3 on an H200). On the slice at an H200's staging it decoded 1.46x "
            "exact at c1 (bench/results/README.md). In fast mode not yet run on a GPU: there it "
            "needs --allow-unrun-modes.",
            group="tiers",
        ),
    ] = False
    ec_freq_window: Annotated[
        NonNegInt | None,
        _s(
            "Expert-cache admission filter: lookups between halvings of the per-expert counts "
            "(default 32 per slot). A miss evicts only an expert looked up less often; 0 admits "
            "every miss (plain CLOCK).",
            group="tiers",
        ),
    ] = None
    warmup: Annotated[
        bool,
        _s(
            "GPU engine: run exllamav3's warm-up at load, so that its kernel picks (the GEMM "
            "autotuner, Triton configs), chosen by timing at first use, are all made before the "
            "first request and kept in their on-disk caches.",
            group="tiers",
            env="GLM53_WARMUP",
        ),
    ] = False
    allow_unrun_modes: Annotated[
        bool,
        _s(
            "GPU engine: also run the three paths that have not yet passed their GPU tests: the "
            "layer split over two or more distinct GPUs (--gpus 0,1; run only as 0,0 on one "
            "GPU), the staging loan in fast mode (--ec-stage-loan; run in exact mode only), and "
            "--prefill layer-major's staging of each layer once per pass in the store modes "
            "(without the flag that pass reads each chunk's picks zero-copy, as its GPU test "
            "passed); for their GPU tests (tests/gpu/test_multi_gpu.py's two-device case, "
            "test_nvme_exact_gpu.py's layer-major case). Without it the GPU engine refuses the "
            "first two. Every other mode and path runs without it (prefill "
            "staging from the store, --nvme-prefetch next-layer and --prefill layer-major in "
            "the store modes, --gpus 0,0: their GPU tests passed on an H100 on 2026-12-05).",
            group="tiers",
        ),
    ] = False
    triton_pin: Annotated[
        str | None,
        _s(
            "Triton kernel pin file (JSON) for exact modes. Not in this build: refused when set.",
            group="tiers",
        ),
    ] = None
    # --- server -------------------------------------------------------------------------------
    host: Annotated[
        str,
        _s(
            "Address to bind; anything but loopback without --api-key draws a warning.",
            group="server",
        ),
    ] = "127.0.0.1"
    port: Annotated[int, Meta(ge=1, le=65535), _s("TCP port.", group="server")] = 30000
    served_name: Annotated[
        str,
        Meta(min_length=1),
        _s("Model id shown by /v1/models and accepted in requests.", group="server"),
    ] = "glm-5.3-flash"
    api_key: Annotated[
        str | None,
        _s(
            "Require `Authorization: Bearer KEY` on every endpoint but /health.",
            group="server",
            secret=True,
        ),
    ] = None
    reasoning_field: Annotated[
        bool,
        _s(
            "Also send the reasoning text as `reasoning` (vLLM's name) beside `reasoning_content`.",
            group="server",
        ),
    ] = False
    max_body_bytes: Annotated[
        int,
        Meta(ge=1024),
        _s("Largest request body; bigger ones get 413.", group="server", kind="size"),
    ] = 32 * 1024 * 1024
    max_prompt_chars: Annotated[
        int,
        Meta(ge=1),
        _s(
            "Most characters in one prompt (a completions or /generate prompt, a /tokenize text, "
            "a chat's message text and its rendered prompt); longer ones get 400 before they are "
            "tokenized (a 16M-character prompt took 14 s to tokenize and 2 GB of RAM).",
            group="limits",
        ),
    ] = 4 * 1024 * 1024
    max_messages: Annotated[
        int,
        Meta(ge=1),
        _s("Most messages in one chat request; more get 400 before rendering.", group="limits"),
    ] = 16384
    max_schema_depth: Annotated[
        int,
        Meta(ge=1),
        _s(
            "Deepest nesting of objects and arrays in a JSON schema (response_format or a tool's "
            "parameters); deeper ones get 400 before a grammar is compiled.",
            group="limits",
        ),
    ] = 32
    max_schema_nodes: Annotated[
        int,
        Meta(ge=1),
        _s(
            "Most values (objects, arrays, keys' values and items) in one JSON schema; larger "
            "ones get 400 before a grammar is compiled (a 10,000-property schema took 0.95 s per "
            "grammar matcher).",
            group="limits",
        ),
    ] = 20000
    drain_timeout: Annotated[
        NonNegFloat,
        _s(
            "Seconds a SIGTERM waits for running and queued requests to finish before the server "
            "stops. While it drains, /health and new requests answer 503 with Retry-After, so a "
            "router sends them elsewhere; 0 stops at once.",
            group="server",
        ),
    ] = 30.0
    drain_grace: Annotated[
        NonNegFloat,
        _s(
            "Least seconds a SIGTERM keeps the server answering 503 before its port closes, when "
            "the drain itself is shorter. A router's health check then takes the replica out "
            "before its connections start failing; behind a router, set it to the router's "
            "health-check interval times its failure threshold. 0 closes as soon as the drain "
            "ends.",
            group="server",
        ),
    ] = 0.0
    log_level: Annotated[LogLevel, _s("Log level.", group="server")] = "info"
    access_log: Annotated[bool, _s("Log every HTTP request.", group="server")] = False


Source = Literal["flag", "env", "default"]


class SettingInfo(msgspec.Struct, frozen=True):
    """One setting as the CLI, the environment and the docs see it."""

    name: str
    flags: tuple[str, ...]
    env: str
    type: Any
    default: Any
    description: str
    group: str
    is_secret: bool
    kind: str


def _field_infos() -> list[SettingInfo]:
    hints = typing.get_type_hints(Settings, include_extras=True)
    infos = []
    for field in msgspec.structs.fields(Settings):
        metas = [m for m in getattr(hints[field.name], "__metadata__", ()) if isinstance(m, Meta)]
        meta = next(m for m in metas if m.extra and "group" in m.extra)
        extra = meta.extra
        flag = "--" + field.name.replace("_", "-")
        infos.append(
            SettingInfo(
                name=field.name,
                flags=(flag, *extra["flags"]),
                env=extra["env"] or "GLM53_" + field.name.upper(),
                type=hints[field.name],
                default=field.default,
                description=meta.description or "",
                group=extra["group"],
                is_secret=bool(extra.get("secret")),
                kind=extra.get("kind", ""),
            )
        )
    return infos


SETTINGS: tuple[SettingInfo, ...] = tuple(_field_infos())
_BY_NAME = {s.name: s for s in SETTINGS}


def setting_info(name: str) -> SettingInfo:
    """The setting `name` as the CLI and the environment spell it (its flags, its variable)."""
    return _BY_NAME[name]


def _base_type(tp: Any) -> Any:
    # Annotated[int | None, ...] -> int | None
    return typing.get_args(tp)[0] if typing.get_origin(tp) is Annotated else tp


def _is_bool(info: SettingInfo) -> bool:
    return _base_type(info.type) is bool


def add_arguments(parser: argparse.ArgumentParser, names: list[str] | None = None) -> None:
    """Add the flags of `names` (all settings by default) to `parser`, grouped. Flags not given
    stay absent from the namespace, so `resolve` can tell a flag from a default."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for info in SETTINGS:
        if names is not None and info.name not in names:
            continue
        group = groups.get(info.group) or parser.add_argument_group(f"{info.group} settings")
        groups[info.group] = group
        default = "unset" if info.default is None else info.default
        help_text = f"{info.description} [env {info.env}; default {default}]"
        help_text = help_text.replace("%", "%%")
        kwargs: dict[str, Any] = {
            "dest": info.name,
            "default": argparse.SUPPRESS,
            "help": help_text,
        }
        if _is_bool(info):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["metavar"] = info.name.upper()
            base = _base_type(info.type)
            if typing.get_origin(base) is Literal:
                kwargs["choices"] = typing.get_args(base)
            elif isinstance(base, type) and issubclass(base, enum.StrEnum):
                kwargs["choices"] = tuple(m.value for m in base)
        group.add_argument(*info.flags, **kwargs)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from `123`, `512K`, `64M`, `1.5G`, `2GiB` (binary multiples, 1K = 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a size; write bytes or a number with K, M, G or T")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** " kmgt".index(unit or " "))


def _convert(info: SettingInfo, raw: Any, origin: str) -> Any:
    where = f"{info.flags[0]}" if origin == "flag" else f"{info.env}"
    if isinstance(raw, str):
        if _is_bool(info):
            low = raw.strip().lower()
            if low not in _TRUE | _FALSE:
                raise ConfigurationError(
                    f"{where}={raw!r}: expected one of 1/0, true/false, yes/no, on/off"
                )
            raw = low in _TRUE
        elif info.kind == "size":
            try:
                raw = parse_size(raw)
            except ValueError as exc:
                raise ConfigurationError(f"{where}: {exc}") from None
        elif info.kind == "int_list":
            items = [t.strip() for t in raw.split(",")]
            if not all(re.fullmatch(r"\d+", t) for t in items):
                raise ConfigurationError(
                    f"{where}={raw!r}: write indices separated by commas, e.g. 0,1 ({info.description})"
                )
            raw = [int(t) for t in items]
    try:
        return msgspec.convert(raw, info.type, strict=False)
    except msgspec.ValidationError as exc:
        message = str(exc).split(" - at ")[0]
        raise ConfigurationError(
            f"{where}={raw!r}: {message} ({info.flags[0]} / {info.env}: {info.description})"
        ) from None


def resolve(
    flags: argparse.Namespace | Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[Settings, dict[str, Source]]:
    """The effective settings and where each value came from: a flag given on the command line
    wins over a GLM53_* variable, which wins over the default. An empty variable counts as unset."""
    given = vars(flags) if isinstance(flags, argparse.Namespace) else dict(flags or {})
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources: dict[str, Source] = {}
    for info in SETTINGS:
        if info.name in given:
            values[info.name] = _convert(info, given[info.name], "flag")
            sources[info.name] = "flag"
        elif environ.get(info.env, "") != "":
            values[info.name] = _convert(info, environ[info.env], "env")
            sources[info.name] = "env"
        else:
            sources[info.name] = "default"
    return Settings(**values), sources


def effective(settings: Settings, sources: Mapping[str, Source]) -> dict[str, dict[str, Any]]:
    """Every setting with its value, source, flag and variable; secrets are shown as set/unset."""
    out = {}
    for info in SETTINGS:
        value = getattr(settings, info.name)
        if info.is_secret:
            value = "<set>" if value else None
        out[info.name] = {
            "value": value,
            "source": sources.get(info.name, "default"),
            "flag": info.flags[0],
            "env": info.env,
        }
    return out


def describe(settings: Settings, sources: Mapping[str, Source]) -> list[str]:
    """One line per setting not at its default, for the start-up log."""
    lines = []
    for name, item in effective(settings, sources).items():
        if item["source"] != "default":
            value = item["value"]
            value = value.value if isinstance(value, enum.Enum) else value
            lines.append(f"{name}={value!r} (from {item['source']} {item[item['source']]})")
    return lines


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "glm53"


def cache_dir(settings: Settings) -> Path:
    return Path(settings.cache_dir).expanduser() if settings.cache_dir else default_cache_dir()


def reference_markdown() -> str:
    """The settings table of docs/reference.md: every flag, variable, default and meaning."""
    lines = []
    for group in dict.fromkeys(s.group for s in SETTINGS):
        lines += [
            f"### {group}",
            "",
            "| flag | environment | default | meaning |",
            "|---|---|---|---|",
        ]
        for info in (s for s in SETTINGS if s.group == group):
            default = "unset" if info.default is None else f"`{info.default}`"
            flags = ", ".join(f"`{f}`" for f in info.flags)
            if _is_bool(info):
                flags += f", `--no-{info.name.replace('_', '-')}`"
            lines.append(f"| {flags} | `{info.env}` | {default} | {info.description} |")
        lines.append("")
    return "\n".join(lines)


def to_json(settings: Settings, sources: Mapping[str, Source]) -> bytes:
    """Settings and sources as one JSON document (hand-off to the server's worker process)."""
    return msgspec.json.encode({"settings": settings, "sources": dict(sources)})


def from_json(data: bytes | str) -> tuple[Settings, dict[str, Source]]:
    decoded = msgspec.json.decode(data, type=dict[str, Any])
    settings = msgspec.convert(decoded["settings"], Settings)
    return settings, dict(decoded["sources"])
