"""What the GPU parity tests share: the checkpoint's sizes, seeded random prompts, stock
exllamav3's reference run in its own process (tools/exl3_reference.py, which never imports
glm53), glm53's GpuEngine or exllamav3's Generator run to the end on those prompts, and the
torch.equal comparison of the two."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


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


def stock_reference(spec: dict, tmp: Path) -> list:
    """tools/exl3_reference.py on `spec` (its docstring has the format): one list of
    {"tokens", "logits"} per run."""
    (tmp / "spec.json").write_text(json.dumps(spec))
    subprocess.run(
        [sys.executable, str(REPO / "tools" / "exl3_reference.py"), str(tmp / "spec.json"),
         str(tmp / "ref.pt")],
        check=True, timeout=1200,
    )  # fmt: skip
    return torch.load(tmp / "ref.pt")


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
    while engine.has_work():
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


def generator_greedy(loaded, prompts: list, n_new: int) -> tuple[dict, dict]:
    """exllamav3's own Generator (max_batch_size 4, ArgmaxSampler, no stop) over a model that
    exl3_load loaded: every prompt enqueued at once; tokens and logits by prompt index."""
    from exllamav3 import ArgmaxSampler, Generator, Job

    gen = Generator(
        model=loaded.model, cache=loaded.cache, tokenizer=loaded.tokenizer, max_batch_size=4
    )
    tokens = {i: [] for i in range(len(prompts))}
    logits = {i: [] for i in range(len(prompts))}
    for i, ids in enumerate(prompts):
        gen.enqueue(
            Job(
                input_ids=ids,
                max_new_tokens=n_new,
                sampler=ArgmaxSampler(),
                stop_conditions=[],
                return_logits=True,
                identifier=i,
            )
        )
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r.get("stage") == "streaming":
                i = r["identifier"]
                if "token_ids" in r:
                    tokens[i] += r["token_ids"].view(-1).tolist()
                if "logits" in r:
                    logits[i].append(r["logits"].float().view(-1, r["logits"].shape[-1]).cpu())
    return tokens, {i: torch.cat(v) for i, v in logits.items()}


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
