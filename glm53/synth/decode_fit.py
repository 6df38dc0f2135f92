"""Routing skew calibrated and measured on a checkpoint's own greedy decoding.

The checkpoint runs as transformers' glm5_next text model with every expert decoded dense (the
same math as the CPU engine, to fp32 rounding: tests/test_cpu_engine.py). Greedy decodes from a
few prompts record every MoE layer's router inputs; each layer's selection bias is refitted on
them (routing.fit_bias, same target and hot set as before) and written back into the shard in
place; after the last round, fresh greedy decodes from two other prompts measure the popularity curve
of their decode picks alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from glm53.models.checkpoint import Checkpoint
from glm53.models.hf_text import build_text_model, lm_head_weight
from glm53.synth import routing
from glm53.synth.tensors import rewrite_tensor

PROMPTS = (
    "[gMASK]<sop><|system|>Reasoning Effort: Max<|user|>Tell me about the sea.<|assistant|><think>",
    "[gMASK]<sop><|user|>Write a function that reverses a list.<|assistant|><think>",
    "[gMASK]<sop><|user|>Plan a weekend trip to the mountains.<|assistant|><think>",
    "[gMASK]<sop><|system|>Reasoning Effort: High<|user|>Why is the sky blue?<|assistant|><think>",
    "[gMASK]<sop><|user|>Explain how a hash table works, with an example.<|assistant|><think>",
)
NUM_FIT_PROMPTS = 3  # the rest measure


class _Recorder:
    """Forward hooks on every MoE router: its input rows and its picks, per call."""

    def __init__(self, model, moe_layers: list[int]):
        self.inputs: dict[int, list[torch.Tensor]] = {i: [] for i in moe_layers}
        self.picks: dict[int, list[torch.Tensor]] = {i: [] for i in moe_layers}
        self.handles = [
            model.layers[i].mlp.gate.register_forward_hook(self._hook(i)) for i in moe_layers
        ]

    def _hook(self, layer: int):
        def hook(module, args, output):
            self.inputs[layer].append(args[0].reshape(-1, args[0].shape[-1]).float().clone())
            self.picks[layer].append(output[2].clone())

        return hook

    def clear(self) -> None:
        for d in (self.inputs, self.picks):
            for v in d.values():
                v.clear()

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _greedy(model, head, tokenizer, prompt: str, new_tokens: int) -> list[int]:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = tokenizer.encode(prompt).ids
    out = []
    with torch.inference_mode():
        hidden = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True).last_hidden_state
        for _ in range(new_tokens):
            token = int((hidden[0, -1] @ head.T).argmax())
            out.append(token)
            hidden = model(
                input_ids=torch.tensor([[token]]), cache=cache, use_cache=True
            ).last_hidden_state
    return out


def calibrate_on_decode(
    directory: str | Path,
    mode: str,
    seed: int,
    rounds: int = 2,
    new_tokens: int = 64,
    measure_tokens: int = 128,
) -> tuple[dict[int, routing.PopularityCurve], dict[int, float]]:
    """Refit every MoE layer's e_score_correction_bias on the checkpoint's own greedy decodes
    (rewriting it in place) and return the measured decode popularity curve and reuse per layer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # decode-sized ops: extra threads only spin (and fight other work)
    try:
        return _calibrate(directory, mode, seed, rounds, new_tokens, measure_tokens)
    finally:
        torch.set_num_threads(threads)


def _calibrate(directory, mode, seed, rounds, new_tokens, measure_tokens):
    from tokenizers import Tokenizer

    ckpt = Checkpoint(directory)
    tokenizer = Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
    model = build_text_model(ckpt)
    head = lm_head_weight(ckpt)
    tc = ckpt.text_config
    num_experts, top_k = int(tc["n_routed_experts"]), int(tc["num_experts_per_tok"])
    rates = routing.target_pick_rates(mode, num_experts, top_k)
    layers = ckpt.moe_layers
    recorder = _Recorder(model, layers)
    fit_inputs: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    try:
        for _ in range(rounds):
            recorder.clear()
            for prompt in PROMPTS[:NUM_FIT_PROMPTS]:
                _greedy(model, head, tokenizer, prompt, new_tokens)
            for i in layers:
                fit_inputs[i].extend(recorder.inputs[i])
                gate = model.layers[i].mlp.gate
                target = np.empty(num_experts)
                target[routing.hot_order(num_experts, seed, i)] = rates
                scores = routing.router_scores(torch.cat(fit_inputs[i]), gate.weight)
                bias = routing.fit_bias(scores, target, top_k)
                with torch.no_grad():
                    gate.e_score_correction_bias.copy_(bias)
                rewrite_tensor(
                    ckpt,
                    f"model.language_model.layers.{i}.mlp.gate.e_score_correction_bias",
                    bias.numpy(),
                )
        decode_picks: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
        reuse_sum = dict.fromkeys(layers, 0.0)
        for prompt in PROMPTS[NUM_FIT_PROMPTS:]:
            recorder.clear()
            _greedy(model, head, tokenizer, prompt, measure_tokens)
            for i in layers:
                picks = torch.cat(recorder.picks[i][1:])  # call 0 is the prompt
                decode_picks[i].append(picks)
                reuse_sum[i] += routing.reuse_rate(picks)
        num_measured = len(PROMPTS) - NUM_FIT_PROMPTS
        curves = {
            i: routing.popularity_curve(
                routing.pick_counts(torch.cat(decode_picks[i]), num_experts)
            )
            for i in layers
        }
        reuse = {i: reuse_sum[i] / num_measured for i in layers}
    finally:
        recorder.close()
    return curves, reuse
