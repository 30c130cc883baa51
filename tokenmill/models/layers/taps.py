"""Hidden-state taps: the residual stream between a target's layers, for the drafters
that read it (EAGLE-3's aux hidden states, DFlash's target layers).

Every decoder runs its layers through `run_layers`, so every architecture exposes the
same taps the same way: the runner sets `model.aux_layer_ids` (layer i: the stream
entering layer i, i.e. HF's `hidden_states[i]`; i == num_layers: the final normed
output) and after each forward `model.aux_hidden` holds them concatenated in that order,
[T, len(ids) * hidden]. Under tensor parallelism the stream between layers is whole on
every rank (each layer ends in its all-reduce), so the taps are too; with chunked
prefill each chunk's forward taps its own rows, as the runner's hidden states are.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

Step = Callable[[int, torch.Tensor], torch.Tensor]
# deferred(i, x, pending) -> (x, pending'): layer i with its last residual add left to the
# next layer (PreNormBlock.forward_deferred); pending None: none due.
DeferredStep = Callable[[int, torch.Tensor, torch.Tensor | None],
                        tuple[torch.Tensor, torch.Tensor]]
Span = Callable[[int, int, torch.Tensor], torch.Tensor]
# tapped(x, taps, ids): every layer in one native call, which copies the stream entering
# layer ids[j] into column block j of taps [T, len(ids) * hidden].
Tapped = Callable[[torch.Tensor, torch.Tensor, tuple[int, ...]], torch.Tensor]


class PreNormBlock:
    """Mixin of the decoder layers built input_layernorm -> self_attn -> (+ residual)
    post_attention_layernorm -> mlp -> (+ residual) (Llama / Qwen / Mistral / Phi-3,
    DeepSeek-V2/V3; Qwen3.5 / Qwen3-Next, whose `mix` is Gated DeltaNet or attention):
    `forward`, and `forward_deferred` for run_layers' folded loop. The norms have
    `add_forward(residual, x)` (residual += x in place, then the norm)."""

    def forward(self, x, cos, sin, rotary, meta):
        # x is this step's own residual stream: updated in place (no autograd here).
        x, mlp_out = self.forward_deferred(x, None, cos, sin, rotary, meta)
        return x.add_(mlp_out)

    def forward_deferred(self, x, pending, cos, sin, rotary, meta):
        """forward with the residual adds moved into the fused add + norm kernels: the
        layer before's MLP output (`pending`, or None) is added to x by this layer's input
        norm, and this layer's own MLP output is returned unadded, (x, mlp_out), for the
        next one's (a separate add was a full pass over the stream each layer: ~5% of
        a bf16 prefill step of the bench model). The same roundings as forward."""
        if pending is None:
            normed = self.input_layernorm(x)
        else:
            normed = self.input_layernorm.add_forward(x, pending)
        h = self.mix(normed, cos, sin, rotary, meta)
        return x, self.mlp(self.post_attention_layernorm.add_forward(x, h))

    def mix(self, normed, cos, sin, rotary, meta):
        """The token mixer between the two norms (a hybrid layer's may be another)."""
        return self.self_attn(normed, cos, sin, rotary, meta)


class HiddenStateTaps:
    """Mixin of the decoder classes: the taps' state and the layer loop that fills it."""

    # spec_decode/loading.py refuses EAGLE-3 / DFlash drafters for a class without it.
    provides_aux_hidden = True
    aux_layer_ids: tuple[int, ...] = ()  # set on the instance by the runner
    aux_hidden: torch.Tensor | None = None

    def run_layers(self, x: torch.Tensor, step: Step, norm: Callable[[torch.Tensor],
                   torch.Tensor], span: Span | None = None,
                   tapped: Tapped | None = None,
                   deferred: tuple[DeferredStep, Callable[[torch.Tensor, torch.Tensor],
                                                          torch.Tensor]] | None = None
                   ) -> torch.Tensor:
        """norm(layers(x)). `step(i, x)` runs layer i; `span(start, end, x)`, when given,
        runs layers [start, end) in one call (a native loop), split at the taps unless
        `tapped` takes them in that one call (a split costs a native call, a copy and
        the dispatch around them per tap, every step). Layers may update x in place: a
        tap keeps a copy. `deferred` = (deferred step, add_norm(x, pending)): the layers
        without taps or a span run with each residual add folded into the next norm (the
        stream is whole only at the end, so only there)."""
        n = len(self.layers)
        ids = self.aux_layer_ids
        if not ids:
            if span is not None:
                return norm(span(0, n, x))
            if deferred is not None and n > 0:
                layer, add_norm = deferred
                pending = None
                for i in range(n):
                    x, pending = layer(i, x, pending)
                return add_norm(x, pending)
            for i in range(n):
                x = step(i, x)
            return norm(x)
        if tapped is not None:
            # (every step of a drafting engine, right after the weights were streamed:
            # each Python object touched here is a cache miss, so as few as can be)
            width = x.shape[1]
            buf = x.new_empty(x.shape[0], len(ids) * width)
            out = norm(tapped(x, buf, ids))
            if n in ids:  # the final normed output (the loop takes layer inputs only)
                for j, i in enumerate(ids):
                    if i == n:
                        buf[:, j * width:(j + 1) * width].copy_(out)
            self.__dict__["aux_hidden"] = buf  # (not nn.Module's __setattr__: its checks)
            return out
        taps: dict[int, torch.Tensor] = {}
        cuts = sorted({i for i in ids if 0 < i < n})
        bounds = list(zip([0] + cuts, cuts + [n]))
        for start, end in bounds:
            if start in ids:
                taps[start] = x.clone()
            if span is not None:
                x = span(start, end, x)
            else:
                for i in range(start, end):
                    x = step(i, x)
        out = norm(x)
        taps[n] = out
        # In the drafter's order; an id may repeat (tiny targets).
        self.aux_hidden = torch.cat([taps[i] for i in ids], dim=-1)
        return out
