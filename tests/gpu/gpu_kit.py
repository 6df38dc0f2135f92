"""What the GPU parity tests share: the checkpoint's sizes, seeded random prompts (one prompt set
for every file that checks the slice against stock exllamav3), stock exllamav3's reference run in
its own process (tools/exl3_reference.py, which never imports glm53), glm53's GpuEngine or
exllamav3's Generator run to the end on those prompts, and the torch.equal comparison of the two.

The reference is shared across the session: a test file names the runs it will ask for in a
module-level `reference_specs()` (conftest.py declares those of every collected file before the
first test), and the first `stock_reference` call on a checkpoint runs every declared run of that
checkpoint in one subprocess (one model load); each prompt run alone, and each set of prompts run
together, is computed once and handed to every file that asks for it.

Across processes: with GLM53_REFERENCE_DIR (tools/gpu-check.sh sets it, one directory per
machine), every unit computed is also saved there, and a process loads a unit saved by another
before computing it. The reference processes of one checkpoint take turns (a lock per checkpoint
in that directory), so groups run side by side do not load the same checkpoint into VRAM at once,
and each finds what the others have computed. A saved unit is keyed by the checkpoint's path and
its config.json's mtime too, so a checkpoint written again is computed again, and by the
exllamav3 tune file (EXLLAMAV3_TUNE_CACHE): stock exllamav3 equals glm53 only under the same
kernel picks, so a unit computed under another tune file is never used.

Kernel picks and order: exllamav3 picks its GEMM kernels by timing at first use and reads its
tune file once, at a process's first tuning; a process that read it before another appended a
key tunes that key itself, maybe otherwise (2026-12-05, H200: groups side by side, each with its
own tune file, compared against references another group's process computed; the 5,000-token
prompt and the batch differed in logits while every shorter prompt was bit-equal). So a session
fetches every reference it declared before its first engine (conftest.py's
`references_before_engines`, `all_declared_references`): the keys those runs hit are in the
tune file before any engine of the session reads it. exllamav3 keeps the last record of a key
it reads, so one race is left: an engine of another session that read the file before a
reference process appended a key, and first meets that key after, tunes it itself and appends
its own pick, which later readers then take. The test prompts' keys are tuned by the warm-up
(tools/exl3_warm.py, before any session) or by the reference runs, which come first in every
session; test_multi_gpu.py compares with its own one-GPU run before stock, so a failure of
this kind shows as such."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]

# The prompt set of the stock-reference checks on the slice (test_generator_parity.py,
# test_nvme_exact_gpu.py, test_multi_gpu.py, test_fast_mode_gpu.py): prompt n of the length list
# is random_ids(vocab, n, 1000 + n), whichever subset a file uses, and each file decodes N_NEW
# tokens, so their references are the same runs. Lengths sit at page (256) and chunk (2,048) edges.
LENGTHS = (1, 2, 9, 25, 100, 255, 256, 257, 300, 2047, 2049, 5000)
BATCH = (300, 2049, 257, 1)  # admitted together: random_ids(vocab, n, 2000 + i) for the i-th
N_NEW = int(os.environ.get("GLM53_PARITY_NEW", "64"))
CHUNK = 2048
CACHE_TOKENS = 16384
PAGE = 256  # exllamav3's KV page


def text_config(path) -> dict:
    cfg = json.loads(Path(path, "config.json").read_text())
    return cfg.get("text_config", cfg)


def num_records(path) -> int:
    """Routed experts over every MoE layer: the VRAM cache's and the RAM tier's keys."""
    tc = text_config(path)
    return sum(t == "sparse" for t in tc["mlp_layer_types"]) * tc["n_routed_experts"]


def expert_slots(path, share: float) -> int:
    """VRAM cache slots holding `share` of the experts (0.114: a 24 GB card's share)."""
    return max(8, int(share * num_records(path)))


def random_ids(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def single_prompts(vocab: int, lengths=LENGTHS) -> dict[int, list[int]]:
    """The shared prompt set's prompts of these lengths, by length."""
    return {n: random_ids(vocab, n, 1000 + n) for n in lengths}


def batch_prompts(vocab: int) -> list[list[int]]:
    """The shared set's prompts admitted together (lengths BATCH, in that order)."""
    return [random_ids(vocab, n, 2000 + i) for i, n in enumerate(BATCH)]


def together_generator() -> dict:
    """The reference Generator's arguments for prompts admitted together: glm53's own
    (generator_settings) at the batch's size, as the engine runs them."""
    from glm53.exl3 import generator_settings

    settings = generator_settings(len(BATCH), CHUNK, 1.0)
    return {k: v for k, v in settings.items() if k != "max_batch_size"}


def reference_spec(path, runs: list[dict], n_new: int = N_NEW) -> dict:
    """A tools/exl3_reference.py spec on `path` at the shared settings (N_NEW new tokens, CHUNK,
    CACHE_TOKENS)."""
    return {"model": str(path), "max_new_tokens": n_new, "cache_tokens": CACHE_TOKENS,
            "max_chunk_size": CHUNK, "runs": runs}  # fmt: skip


def singles_spec(path, lengths) -> dict:
    """The reference spec of the shared set's prompts of `lengths`, each run alone."""
    prompts = single_prompts(text_config(path)["vocab_size"], lengths)
    return reference_spec(path, [{"prompts": [prompts[n] for n in lengths]}])


def checkpoint_dir(env: str) -> str | None:
    """The checkpoint directory the environment variable names, None if it names none."""
    path = os.environ.get(env)
    return path if path and os.path.isfile(os.path.join(path, "config.json")) else None


_REFERENCE: dict[str, object] = {}  # unit key -> {"tokens", "logits"} (alone) or a list (together)
_DECLARED: list[dict] = []  # the specs collected test files will ask for (declare_reference)


def _load_key(spec: dict) -> str:
    """What one reference process shares: the checkpoint, its cache size and chunk."""
    return json.dumps([os.path.realpath(spec["model"]), spec.get("cache_tokens", 16384),
                       spec.get("max_chunk_size", 2048)])  # fmt: skip


def _whole(run: dict) -> bool:
    """Whether a run is one unit: prompts admitted together, or a run with its floor (whose
    other arrangement needs the whole run)."""
    return bool(run.get("together") or run.get("floor"))


def _units(spec: dict) -> list[tuple[str, dict]]:
    """The spec's independent runs with their keys: each prompt of a run that runs prompts
    alone (a fresh Generator each, so nothing around it changes its result), each run of
    prompts admitted together, or with its floor, as a whole."""
    out = []
    for r in spec["runs"]:
        n_new = r.get("max_new_tokens", spec["max_new_tokens"])
        gen = r.get("generator", {})
        groups = [r["prompts"]] if _whole(r) else [[p] for p in r["prompts"]]
        for prompts in groups:
            unit = {"prompts": prompts, "together": bool(r.get("together")),
                    "generator": gen, "max_new_tokens": n_new}  # fmt: skip
            if r.get("floor"):
                unit["floor"] = True
            out.append((json.dumps([_load_key(spec), unit], sort_keys=True), unit))
    return out


def _shared_dir() -> Path | None:
    d = os.environ.get("GLM53_REFERENCE_DIR")
    return Path(d) if d else None


def _shared_file(d: Path, spec: dict, key: str) -> Path:
    config = Path(spec["model"], "config.json")
    written = config.stat().st_mtime_ns if config.exists() else 0
    tune = os.environ.get("EXLLAMAV3_TUNE_CACHE", "")  # the picks it was computed under
    tune = os.path.realpath(tune) if tune else ""
    return d / (hashlib.sha1(f"{written} {tune} {key}".encode()).hexdigest() + ".pt")


@contextlib.contextmanager
def _turn(d: Path | None, spec: dict):
    """This process's turn at the checkpoint's reference (an exclusive lock in the shared
    directory); nothing without one."""
    if d is None:
        yield
        return
    d.mkdir(parents=True, exist_ok=True)
    # per checkpoint, whatever the cache size or chunk: one copy of its experts in VRAM at a time
    name = hashlib.sha1(os.path.realpath(spec["model"]).encode()).hexdigest() + ".lock"
    with open(d / name, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _from_shared(d: Path | None, spec: dict, units: dict) -> None:
    """Load into _REFERENCE the units another process saved; drop them from `units`."""
    if d is None:
        return
    for key in list(units):
        f = _shared_file(d, spec, key)
        if f.is_file():
            _REFERENCE[key] = torch.load(f)
            del units[key]


def declare_reference(spec: dict) -> None:
    """Name runs a test will ask stock_reference for, so that the first call on the checkpoint
    computes them in the same process (conftest.py declares every collected file's)."""
    _DECLARED.append(spec)


def all_declared_references(tmp: Path) -> int:
    """Compute (or load from GLM53_REFERENCE_DIR) every declared run now, one reference process
    per checkpoint at most; returns how many specs were declared. conftest.py calls it before
    the session's first test, so that no engine of the session reads exllamav3's tune file
    before the reference runs have put their kernel picks in it (the module's docstring)."""
    for spec in list(_DECLARED):
        stock_reference(spec, tmp)
    return len(_DECLARED)


def stock_reference(spec: dict, tmp: Path) -> list:
    """Stock exllamav3's runs of `spec` (tools/exl3_reference.py's format): one list of
    {"tokens", "logits"} per run (with "floor_logits" for a run with "floor"). Runs computed earlier in the session are reused; the missing
    ones, with every declared run of the same checkpoint not yet computed, run in one
    tools/exl3_reference.py process."""
    wanted = _units(spec)
    missing = {key: unit for key, unit in wanted if key not in _REFERENCE}
    shared = _shared_dir()
    if missing:
        with _turn(shared, spec):
            _from_shared(shared, spec, missing)
            if missing:
                _compute(spec, missing, tmp, shared)
    out, i = [], 0
    for r in spec["runs"]:
        n = 1 if _whole(r) else len(r["prompts"])
        got = [_REFERENCE[key] for key, _ in wanted[i : i + n]]
        out.append(got[0] if _whole(r) else got)
        i += n
    return out


def _compute(spec: dict, missing: dict, tmp: Path, shared: Path | None) -> None:
    """Run `missing` with every declared unit of the same checkpoint not yet known (here or in
    the shared directory) in one tools/exl3_reference.py process; keep and share the results."""
    for other in _DECLARED:
        if _load_key(other) == _load_key(spec):
            more = {key: unit for key, unit in _units(other) if key not in _REFERENCE}
            _from_shared(shared, spec, more)
            for key, unit in more.items():
                missing.setdefault(key, unit)
    batch = dict(spec, runs=list(missing.values()))
    (tmp / "spec.json").write_text(json.dumps(batch))
    subprocess.run(
        [sys.executable, str(REPO / "tools" / "exl3_reference.py"), str(tmp / "spec.json"),
         str(tmp / "ref.pt")],
        check=True, timeout=1200,
    )  # fmt: skip
    results = torch.load(tmp / "ref.pt")
    for (key, unit), res in zip(missing.items(), results, strict=True):
        _REFERENCE[key] = res if _whole(unit) else res[0]
        if shared is not None:  # written whole, then renamed: a reader never sees a part
            f = _shared_file(shared, spec, key)
            torch.save(_REFERENCE[key], f.with_suffix(".part"))
            os.replace(f.with_suffix(".part"), f)


def bounded(limit: int, what):
    """range(limit), for a loop that must end well before it (break out when done): past the
    limit it fails, naming `what` (a string, or a callable that says it then), instead of
    spinning until the group's deadline kills the run and every test after it (2026-12-05: a
    loop waiting for a layer-major pass that the prefix cache had made unneeded)."""
    yield from range(limit)
    raise AssertionError(f"{what() if callable(what) else what}: not done after {limit} iterations")


def iteration_limit(prompts: list, n_new: int) -> int:
    """Iterations that running `prompts` (token lists, or [1, n] tensors) to the end cannot
    need, even one prompt after another: per prompt a forward per page (the Generator's chunks
    are whole pages but the last), one per module of a layer-major pass (fewer than 256) and a
    decode step per new token; twice that, plus 100."""
    lengths = [p.shape[-1] if hasattr(p, "shape") else len(p) for p in prompts]
    return 2 * sum(n // PAGE + 2 + 256 + n_new for n in lengths) + 100


def run_engine(engine, prompts: list, n_new: int) -> list[dict]:
    """Start every prompt at once (admitted together, in order) on a loaded GpuEngine, greedy,
    and iterate to the end: per prompt its tokens, its logits (one row per token) and the
    cached tokens its start reported."""
    from glm53.engine.sampling import SamplingParams
    from glm53.engine.scheduler import GenerationRequest

    outs = {}
    for i, p in enumerate(prompts):
        req = GenerationRequest(prompt_ids=p, sampling=SamplingParams(temperature=0.0))
        engine.start(i, req, n_new, return_logits=True)
        outs[i] = {"tokens": [], "logits": [], "cached": None}
    limit = iteration_limit(prompts, n_new)
    for _ in bounded(limit, lambda: f"run_engine, {len(prompts)} prompts: {engine.stats()}"):
        if not engine.has_work():
            break
        for o in engine.iterate():
            assert o.finish != "error", o.error
            d = outs[o.key]
            d["tokens"].extend(o.token_ids)
            if o.logits is not None:
                d["logits"].append(o.logits.cpu())
            if o.cached_tokens is not None:
                d["cached"] = o.cached_tokens
    for d in outs.values():
        d["logits"] = torch.cat(d["logits"])
    return [outs[i] for i in range(len(prompts))]


@contextlib.contextmanager
def copy_first_uncached(engine):
    """An exact-mode engine's prefill stages with PrefillStager.copy_first (the copy queued
    before the unstage kernel; not yet the default) and its prefix cache off, so that prompts
    that ran before are prefilled and staged whole again; both back as they were after.
    Yields the stager."""
    stager = engine.loaded.stager
    assert stager is not None and stager.dma, "exact mode's staging is the copy engine's here"
    stager.copy_first = True
    engine.prefix_cache = False
    try:
        yield stager
    finally:
        del stager.copy_first  # the class's default again
        engine.prefix_cache = True


@functools.cache
def _reference_tool():
    """tools/exl3_reference.py as a module (it is a script, not in a package)."""
    import importlib.util

    path = REPO / "tools" / "exl3_reference.py"
    spec = importlib.util.spec_from_file_location("exl3_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def forced_sampler(tokens: list[int]):
    """tools/exl3_reference.py's teacher-forcing Sampler (draws `tokens` in order), so that the
    stock reference and the tests force tokens the same way."""
    return _reference_tool().forced_sampler(tokens)


def generator_run(loaded, prompts: list, n_new: int, forced=None, together=True):
    """exllamav3's own Generator (no stop) over a model that exl3_load loaded: every prompt
    enqueued at once at max_batch_size 4 (together), or each alone at max_batch_size 1; greedy
    (ArgmaxSampler), or teacher-forced on `forced` (a token list per prompt). Tokens and logits
    by prompt index."""
    from exllamav3 import ArgmaxSampler, Generator, Job

    tokens = {i: [] for i in range(len(prompts))}
    logits = {i: [] for i in range(len(prompts))}
    batch = 4 if together else 1
    for first in range(0, len(prompts), batch):
        gen = Generator(
            model=loaded.model, cache=loaded.cache, tokenizer=loaded.tokenizer, max_batch_size=batch
        )
        for i in range(first, min(first + batch, len(prompts))):
            gen.enqueue(
                Job(
                    input_ids=prompts[i],
                    max_new_tokens=n_new,
                    sampler=ArgmaxSampler() if forced is None else forced_sampler(forced[i]),
                    stop_conditions=[],
                    return_logits=True,
                    identifier=i,
                )
            )
        group = prompts[first : first + batch]
        for _ in bounded(iteration_limit(group, n_new), f"generator_run, {len(group)} prompts"):
            if not gen.num_remaining_jobs():
                break
            for r in gen.iterate():
                if r.get("stage") == "streaming":
                    i = r["identifier"]
                    if "token_ids" in r:
                        tokens[i] += r["token_ids"].view(-1).tolist()
                    if "logits" in r:
                        logits[i].append(r["logits"].float().view(-1, r["logits"].shape[-1]).cpu())
    return tokens, {i: torch.cat(v) for i, v in logits.items()}


def kl_top1(wants: list, gots: list, tokens: list) -> tuple[float, float]:
    """Teacher-forced fidelity over every position of every prompt: the mean KL(want || got)
    of the next-token distributions, and the share of positions where got's argmax is the
    forced token (want's own greedy pick)."""
    kls, agree, total = [], 0, 0
    for want, got, toks in zip(wants, gots, tokens, strict=True):
        want, got = want.float(), got.float()
        assert got.shape == want.shape, (got.shape, want.shape)
        pa, pb = torch.log_softmax(want, -1), torch.log_softmax(got, -1)
        kls.append((pa.exp() * (pa - pb)).sum(-1))
        agree += int((got.argmax(-1) == torch.tensor(toks)).sum())
        total += len(toks)
    return torch.cat(kls).mean().item(), agree / total


def exl3_linears(expert, device) -> list:
    """An expert's gate, up and down (numpy trellis, suh and svh, as glm53's lane tests make
    them) as exllamav3 LinearEXL3 modules on `device`, mul1 codebook."""
    from exllamav3.modules.quant.exl3 import LinearEXL3

    marker = torch.tensor(0, dtype=torch.int32, device=device)
    return [
        LinearEXL3(
            None,
            lin.in_features,
            lin.out_features,
            mul1=marker,
            trellis=torch.from_numpy(lin.trellis).to(device),
            suh=torch.from_numpy(lin.suh).to(device),
            svh=torch.from_numpy(lin.svh).to(device),
        )
        for lin in expert
    ]


def assert_same(got: dict, want: dict, what: str) -> None:
    """Tokens equal and logits torch.equal (the largest difference in the message if not)."""
    assert got["tokens"] == want["tokens"], f"{what}: tokens differ"
    assert got["logits"].shape == want["logits"].shape, what
    diff = (got["logits"] - want["logits"]).abs().max().item()
    assert torch.equal(got["logits"], want["logits"]), f"{what}: logits differ by up to {diff}"
