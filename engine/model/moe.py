"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite MoE, GPT-OSS, GLM-4.5,
Llama 4): a router picks each token's top-k experts, each an MLP of its own, and their outputs
are summed, weighted by the router's probabilities (GLM-4.5: DeepSeek-V3's sigmoid scores,
`MoE`; Llama 4 weighs each expert's input by the sigmoid of its logit instead);
Qwen2-MoE adds a shared expert every token runs, gated by a sigmoid, Granite MoE (shared),
GLM-4.5, HunYuan and Llama 4 one ungated.

As transformers runs it: the experts in order, each on its tokens alone (gathered, then
added back with `index_add_`), the weights applied in float32 for Mixtral and in the
model's dtype for Qwen, so that a half-precision model rounds where transformers' does.

Tensor-parallel: every rank routes alike (the router is whole on each) and runs each
expert's slice of the intermediate dimension; the layer's all-reduce sums the slices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .arch import MoE
from .linear import Linear


@dataclass
class SharedExpert:
    gate_up: Linear
    down: Linear
    gate: torch.Tensor | None  # [1, hidden]: sigmoid(h @ gate.T) scales the output (Qwen2-MoE); None: 1 (Granite)


@dataclass
class Experts:
    moe: MoE
    router: Linear  # [experts, hidden], with GPT-OSS's bias
    gate_up: list[Linear]  # each expert's gate | up
    down: list[Linear]
    shared: SharedExpert | None = None
    correction: torch.Tensor | None = None  # float32 [experts]: added to the scores that choose (MoE.sigmoid)

    @classmethod
    def load(cls, moe: MoE, prefix: str, take, maybe, fused) -> "Experts":
        """The experts under `prefix` (`model.layers.N.mlp.`), Qwen's names (names.to_llama_names)."""
        experts = range(moe.experts)
        shared = None
        down = maybe(prefix + "shared_expert.down_proj.weight")
        if down is not None:
            shared = SharedExpert(fused(prefix + "shared_expert.", ("gate_proj", "up_proj")),
                                  Linear(down, maybe(prefix + "shared_expert.down_proj.bias")),
                                  maybe(prefix + "shared_expert_gate.weight"))
        # The router stays plain F.linear: its logits pick the experts, so they round as transformers' do.
        return cls(moe, Linear(take(prefix + "gate.weight"), maybe(prefix + "gate.bias"), pack=False),
                   [fused(f"{prefix}experts.{e}.", ("gate_proj", "up_proj")) for e in experts],
                   [Linear(take(f"{prefix}experts.{e}.down_proj.weight"), maybe(f"{prefix}experts.{e}.down_proj.bias"))
                    for e in experts], shared, maybe(prefix + "gate.e_score_correction_bias"))

    def __call__(self, h: torch.Tensor, act_mul) -> torch.Tensor:
        """The layer's MLP output [T, hidden] of normed hidden states h [T, hidden]; `act_mul`:
        the model's activation of the gate times the up projection (`ops.silu_mul`)."""
        k = self.moe.top_k
        corrected = self.moe.sigmoid or self.correction is not None  # weighed (and renormalised) there
        if corrected:
            weights, chosen = self._corrected_route(h)
        elif self.moe.scales_input:  # Llama 4: the sigmoid of each chosen logit, in float32
            top, chosen = torch.topk(self.router(h), k, dim=-1)
            weights = torch.sigmoid(top.float())
        elif self.moe.softmax_top_k:
            logits = self.router(h)
            top, chosen = torch.topk(logits.float(), k, dim=-1)
            weights = torch.softmax(top, dim=-1)
        else:
            weights, chosen = torch.topk(torch.softmax(self.router(h), dim=-1, dtype=torch.float32), k, dim=-1)
        if self.moe.normalize and not corrected:
            weights /= weights.sum(dim=-1, keepdim=True)
        if not self.moe.weights_fp32:
            weights = weights.to(h.dtype)
        weights = weights.view(-1)
        # (token, slot) pairs grouped by expert: one host read of the counts a step.
        order = torch.argsort(chosen.view(-1), stable=True)
        counts = torch.bincount(chosen.view(-1), minlength=self.moe.experts).tolist()
        out = torch.zeros_like(h)
        begin = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            pairs = order[begin:begin + n]
            begin += n
            tokens = pairs // k
            x = h.index_select(0, tokens)
            if self.moe.scales_input:
                x = x * weights[pairs, None]
            y = self.down[e](act_mul(self.gate_up[e](x)))
            out.index_add_(0, tokens, (y if self.moe.scales_input else y * weights[pairs, None]).to(out.dtype))
        if self.shared is not None:
            s = self.shared
            y = s.down(act_mul(s.gate_up(h)))
            out = out + (y if s.gate is None else torch.sigmoid(F.linear(h, s.gate)) * y)
        return out

    def _corrected_route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts) [T, k] as DeepSeek-V3 routes (GLM-4.5) or ERNIE 4.5, in float32 as
        transformers keeps their routers: experts chosen by score (sigmoid; ERNIE's softmax)
        plus the correction bias, only from the groups whose two best such scores sum
        highest; weighted by their own scores."""
        moe, T = self.moe, h.shape[0]
        logits = F.linear(h.float(), self.router.weight.float())
        scores = logits.sigmoid() if moe.sigmoid else torch.softmax(logits, dim=-1)
        choice = scores if self.correction is None else scores + self.correction.float()
        groups, kept = moe.groups
        if kept < groups:
            best = choice.view(T, groups, -1).topk(2, dim=-1)[0].sum(dim=-1)  # [T, groups]
            mask = torch.zeros_like(best).scatter_(1, torch.topk(best, kept, dim=-1)[1], 1.0)
            choice = choice.masked_fill(~mask.bool().repeat_interleave(moe.experts // groups, dim=1), float("-inf"))
        chosen = torch.topk(choice, moe.top_k, dim=-1)[1]
        weights = scores.gather(1, chosen)
        if moe.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * moe.scaling, chosen
