"""The built-in transformer of aloe-worker (worker/transformer.h) as a torch.nn.Module: the same
function and the same parameter names, shapes and order, so that a Python worker trains the
model of a server configured with `model { ... }` together with C++ workers."""

import math

import torch
from torch import nn
from torch.nn import functional as F

# PyTorch 2.x has fused attention; 1.13 (Debian 12's) runs the three-step form.
FUSED_ATTENTION = hasattr(F, "scaled_dot_product_attention")


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x, causal_mask):
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if FUSED_ATTENTION:
            # One fused kernel, as aloe-worker on LibTorch 2.x: the same function up to rounding.
            y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, t, d))
        q = qkv[0] * (1.0 / math.sqrt(self.head_dim))
        scores = torch.matmul(q, qkv[1].transpose(-2, -1)).masked_fill(causal_mask, -math.inf)
        y = torch.matmul(torch.softmax(scores, -1), qkv[2])
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Mlp(nn.Module):
    def __init__(self, d_model, hidden):
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden)
        self.fc2 = nn.Linear(hidden, d_model)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, d_model, num_heads, hidden):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, num_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = Mlp(d_model, hidden)

    def forward(self, x, causal_mask):
        h = x + self.attn(self.ln1(x), causal_mask)
        return h + self.mlp(self.ln2(h))


class TransformerLM(nn.Module):
    """logits = head(ln_f(blocks(tok_emb(tokens) + pos_emb(positions)))).

    `config` is the server's TransformerConfig (JoinReply.model, Worker.model_config) or any
    object with vocab_size, seq_len, d_model, num_layers, num_heads and ffn_mult."""

    def __init__(self, config):
        super().__init__()
        d = config.d_model
        self.tok_emb = nn.Embedding(config.vocab_size, d)
        self.pos_emb = nn.Embedding(config.seq_len, d)
        self.blocks = nn.ModuleList(
            Block(d, config.num_heads, config.ffn_mult * d) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, config.vocab_size, bias=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        positions = torch.arange(t, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        mask = torch.ones(t, t, dtype=torch.bool, device=tokens.device).triu(1)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))

    def loss(self, tokens):
        """Mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1]."""
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
