#!/usr/bin/python3
"""Writes the bring-your-own TorchScript modules of byo_model_test.cc (Debian's python3-torch).

  make_torchscript_models.py OUT_DIR [HELDOUT_SHARD WINDOWS]

OUT_DIR/logits.pt  forward(inputs [B,T]) -> logits [B,T,V]: a small pre-LN transformer LM with a
                   root parameter (pos), tok_emb, blocks (a ModuleList), ln_f and head; int
                   attributes vocab_size 256 and seq_len 32.
OUT_DIR/loss.pt    forward(inputs, targets) -> mean cross-entropy; an embedding + MLP model.
OUT_DIR/three_args.pt  forward(a, b, c): not a trainable model.
With HELDOUT_SHARD (an ALOE token shard) it prints "heldout_loss=X": the logits model's mean
per-token cross-entropy over the first WINDOWS non-overlapping windows of seq_len + 1 tokens,
evaluated in PyTorch: the golden value for the evaluator's version-0 loss.
"""
import math
import struct
import sys

import torch
import torch.nn.functional as F

VOCAB, SEQ, D, HEADS = 256, 32, 48, 2


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = HEADS
        self.ln1 = torch.nn.LayerNorm(D)
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.proj = torch.nn.Linear(D, D)
        self.ln2 = torch.nn.LayerNorm(D)
        self.fc1 = torch.nn.Linear(D, 4 * D)
        self.fc2 = torch.nn.Linear(4 * D, D)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q = q.view(b, t, h, d // h).transpose(1, 2)
        k = k.view(b, t, h, d // h).transpose(1, 2)
        v = v.view(b, t, h, d // h).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // h)
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class LogitsLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.vocab_size = VOCAB
        self.seq_len = SEQ
        self.pos = torch.nn.Parameter(0.02 * torch.randn(SEQ, D))
        self.tok_emb = torch.nn.Embedding(VOCAB, D)
        self.blocks = torch.nn.ModuleList([Block() for _ in range(2)])
        self.ln_f = torch.nn.LayerNorm(D)
        self.head = torch.nn.Linear(D, VOCAB, bias=False)
        with torch.no_grad():
            self.tok_emb.weight.normal_(0, 0.02)
            self.head.weight.normal_(0, 0.02)

    def forward(self, inputs):
        x = self.tok_emb(inputs) + self.pos[: inputs.size(1)]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class LossLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.vocab = VOCAB
        self.emb = torch.nn.Embedding(VOCAB, D)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(D, 4 * D), torch.nn.GELU(),
                                       torch.nn.Linear(4 * D, VOCAB))

    def forward(self, inputs, targets):
        logits = self.mlp(self.emb(inputs))
        return F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))


class ThreeArgs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(2, 2)

    def forward(self, a, b, c):
        return self.w(a + b + c)


def read_shard(path):
    with open(path, "rb") as f:
        data = f.read()
    magic, version, dtype, count, _vocab, _ = struct.unpack("<8sIIQII", data[:32])
    assert magic == b"ALOETOKS" and version == 1, path
    fmt = {2: "H", 4: "I"}[dtype]
    return list(struct.unpack("<%d%s" % (count, fmt), data[32:32 + count * dtype]))


def main():
    torch.manual_seed(1)
    out = sys.argv[1]
    logits = torch.jit.script(LogitsLM())
    logits.save(out + "/logits.pt")
    torch.jit.script(LossLM()).save(out + "/loss.pt")
    torch.jit.script(ThreeArgs()).save(out + "/three_args.pt")
    if len(sys.argv) > 2:
        tokens = read_shard(sys.argv[2])
        windows = min(int(sys.argv[3]), len(tokens) // (SEQ + 1))
        batch = torch.tensor(tokens[: windows * (SEQ + 1)]).view(windows, SEQ + 1)
        logits.eval()
        with torch.no_grad():
            out_logits = logits(batch[:, :-1])
            loss = F.cross_entropy(out_logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        print("heldout_loss=%.9f" % loss.item())


if __name__ == "__main__":
    main()
