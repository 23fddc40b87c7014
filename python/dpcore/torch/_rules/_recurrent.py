"""Rules of recurrent layers.

* ``nn.LSTM``, ``nn.GRU``, ``nn.RNN``: a hand-written backward through time hands each step's
  gate gradients to factored uses of ``weight_ih``/``weight_hh`` (see ``torch/_rnn.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from .._contrib import Factored
from ._base import LayerRule


class RecurrentRule(LayerRule):
    """``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` with their own parameters (no module swap): the
    recurrence runs in ``_rnn.py``, whose backward through time hands, per layer and direction,
    the gate gradients d_ih, d_hh (B, T, G·H) with the step inputs x and h_{t−1}; weight_ih is
    then the factored use Σ_t d_ih,t x_tᵀ, weight_hh Σ_t d_hh,t h_{t−1}ᵀ, and the biases Σ_t d."""

    kind = "recurrent"

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        if getattr(self.module, "proj_size", 0):
            raise ValueError(f"layer {self.name!r}: LSTM with proj_size > 0 is not supported")

    def forward(self, input: Any, hx: Any = None) -> Any:
        from .._rnn import recurrent_forward

        def sink(layer: int, direction: int, x: torch.Tensor, h_prev: torch.Tensor, d_ih: torch.Tensor, d_hh: torch.Tensor) -> None:
            sfx = f"_l{layer}" + ("_reverse" if direction else "")
            for name, a, g in (("weight_ih", x, d_ih), ("weight_hh", h_prev, d_hh), ("bias_ih", None, d_ih), ("bias_hh", None, d_hh)):
                p = self.p(name + sfx)
                if p is not None:
                    self.add(Factored(p, a, g))

        # one node per layer and direction, whose backward adds each of its four parameters once
        self.expect(*self.params.values())
        return recurrent_forward(self.module, input, hx, sink=sink, anchor=self.engine.anchor)
