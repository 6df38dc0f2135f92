"""Stock exllamav3 1.6.5's own generation, as the reference that glm53's exact mode must equal.

    python tools/exl3_reference.py SPEC.json OUT.pt

Runs in its own process and never imports glm53, so none of glm53's hooks can be in the way:
exllamav3 as shipped loads the checkpoint with every expert in VRAM, and its `Generator` decodes
greedily (`ArgmaxSampler`, no stop tokens). SPEC (JSON):

    {"model": DIR, "max_new_tokens": 64, "cache_tokens": 16384, "max_chunk_size": 2048,
     "runs": [{"prompts": [[ids...], ...],
               "together": false,      # false: each prompt alone, in a fresh Generator at
                                       # max_batch_size 1; true: all enqueued together, in
                                       # order, at max_batch_size len(prompts)
               "generator": {extra Generator keyword arguments},
               "max_new_tokens": 48,   # optional: this run's, instead of the spec's
               "floor": true}, ...]}   # optional: also exllamav3's rounding floor (below)

A spec may hold the runs of several test files on one checkpoint (tests/gpu/gpu_kit.py batches
them so that the model loads once per checkpoint): each prompt run alone gets a fresh Generator,
so its result does not depend on the runs around it.

OUT holds a list per run and in it, per prompt, the generated tokens (list) and the logits each
was sampled from (a float tensor [n, vocab], as the Generator returns them with return_logits).

A run with "floor" is also run in the other arrangement (prompts admitted together if the run
runs them alone, each alone if it runs them together), teacher-forced on the run's own tokens:
each prompt then also holds "floor_logits", the logits of that other arrangement at the same
positions. They differ from "logits" only by exllamav3's own rounding at another batch (other
GEMM shapes, other kernels), which is the floor a near-exact mode is judged against.
"""

from __future__ import annotations

import json
import sys


def run(spec: dict) -> list[list[dict]]:
    from exllamav3 import Cache, Config, Model, Tokenizer

    config = Config.from_directory(spec["model"])
    model = Model.from_config(config)
    # the cache's recurrent state slots bound the Generator's batch: one cache with enough for
    # the largest run; each run's Generator asks for its own max_batch_size
    batch = max(len(r["prompts"]) if r.get("together") else 1 for r in spec["runs"])
    chunk = spec.get("max_chunk_size", 2048)
    cache = Cache(model, max_num_tokens=spec.get("cache_tokens", 16384), max_batch_size=batch)
    model.load("cuda:0", max_chunk_size=chunk)
    tokenizer = Tokenizer.from_config(config)
    try:
        return [
            _run_one(model, cache, tokenizer, config.vocab_size, spec, r, chunk)
            for r in spec["runs"]
        ]
    finally:
        model.unload()


def forced_sampler(tokens: list[int]):
    """An exllamav3 Sampler that draws `tokens` in order, whatever the logits (teacher forcing
    through the Generator's own decode path, which still returns the logits it drew from)."""
    import torch
    from exllamav3.generator.sampler import Sampler

    class Forced(Sampler):
        def __init__(self):
            super().__init__()
            self.i = 0

        def forward(self, logits, *args, **kwargs):
            token = tokens[self.i]
            self.i += 1
            return torch.tensor([token], dtype=torch.long).view(logits.shape[:-1])

    return Forced()


def _run_one(model, cache, tokenizer, vocab, spec, run_spec, chunk) -> list[dict]:
    together = run_spec.get("together", False)
    n_new = run_spec.get("max_new_tokens", spec["max_new_tokens"])
    out = _generate(model, cache, tokenizer, vocab, run_spec, chunk, together, n_new)
    if run_spec.get("floor"):
        forced = [o["tokens"] for o in out]
        other = _generate(model, cache, tokenizer, vocab, run_spec, chunk, not together, n_new,
                          forced)  # fmt: skip
        for o, f in zip(out, other, strict=True):
            o["floor_logits"] = f["logits"]
    return out


def _generate(model, cache, tokenizer, vocab, run_spec, chunk, together, n_new, forced=None):
    """The run's prompts alone (a fresh Generator at max_batch_size 1 each) or together (one
    Generator at max_batch_size len(prompts)), with the run's extra Generator arguments either
    way; greedy, or teacher-forced on `forced` (per prompt)."""
    import torch
    from exllamav3 import ArgmaxSampler, Generator, Job

    prompts = run_spec["prompts"]
    batch = len(prompts) if together else 1
    out = []
    for first in range(0, len(prompts), batch):
        group = prompts[first : first + batch]
        kwargs = {"max_batch_size": batch, "max_chunk_size": chunk}
        kwargs.update(run_spec.get("generator", {}))
        gen = Generator(model=model, cache=cache, tokenizer=tokenizer, **kwargs)
        results = {i: {"tokens": [], "logits": []} for i in range(len(group))}
        for i, ids in enumerate(group):
            gen.enqueue(
                Job(
                    input_ids=torch.tensor([ids], dtype=torch.long),
                    max_new_tokens=n_new,
                    sampler=ArgmaxSampler() if forced is None else forced_sampler(
                        forced[first + i]),
                    stop_conditions=[],
                    return_logits=True,
                    identifier=i,
                )
            )  # fmt: skip
        while gen.num_remaining_jobs():
            for r in gen.iterate():
                if r["stage"] == "error":
                    raise RuntimeError(f"reference job {r['identifier']}: {r['error']}")
                if r["stage"] != "streaming":
                    continue
                for part in (r, r.get("held") if r.get("eos") else None):
                    if part and "token_ids" in part:
                        res = results[r["identifier"]]
                        res["tokens"].extend(part["token_ids"].view(-1).tolist())
                        res["logits"].append(part["logits"][0, :, :vocab].float().cpu())
        gen.close()
        for i in range(len(group)):
            res = results[i]
            out.append({"tokens": res["tokens"], "logits": torch.cat(res["logits"])})
    return out


def main(argv=None) -> int:
    import torch

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    with torch.inference_mode():
        torch.save(run(spec), argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
