"""The model ema_bench.py trains: a plain pre-norm decoder-only transformer
(GPT-2's layout: LayerNorm, causal self-attention through
scaled_dot_product_attention, a 4x GELU MLP), untied embedding and head.
Parameters: 12 x layers x width^2 + 2 x vocab x width (+ the norms);
width 2048, 24 layers, vocab 32000: 1.34 B."""
import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.norm2 = nn.LayerNorm(width)
        self.mlp_in = nn.Linear(width, 4 * width, bias=False)
        self.mlp_out = nn.Linear(4 * width, width, bias=False)

    def forward(self, x):
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, width // self.heads).transpose(1, 2)
                   for t in (q, k, v))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, seq, width))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.norm2(x))))


class Transformer(nn.Module):
    """Built on `device` directly (a 1.3 B model initialised on the CPU would
    take longer than its 30 steps); "meta" counts parameters for nothing."""

    def __init__(self, vocab, width, layers, heads, seq, device="cpu"):
        super().__init__()
        with torch.device(device):
            self.embed = nn.Embedding(vocab, width)
            self.position = nn.Parameter(torch.zeros(seq, width))
            self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)
            for name, p in self.named_parameters():
                if p.dim() == 2 and name != "position":
                    nn.init.normal_(p, std=0.02)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def parameter_count(model):
    return sum(p.numel() for p in model.parameters())
