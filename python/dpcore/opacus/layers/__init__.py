"""Opacus's DP layers as names: dpcore has per-record rules for torch's own recurrent and
attention layers, so ``DPLSTM`` is ``nn.LSTM`` (and so on) and needs no replacement."""

from torch import nn

DPLSTM = nn.LSTM
DPGRU = nn.GRU
DPRNN = nn.RNN
DPMultiheadAttention = nn.MultiheadAttention

__all__ = ["DPLSTM", "DPGRU", "DPRNN", "DPMultiheadAttention"]
