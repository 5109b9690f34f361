"""The inner AdamW configuration defaults and learning-rate schedule (common/lr_schedule.h):
linear warmup, then cosine decay to min_lr (paper 002 Eq. 3), per data shard position."""

import math

DEFAULTS = {"lr": 3e-3, "warmup_steps": 50, "total_steps": 10000, "weight_decay": 0.1,
            "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "grad_clip": 1.0, "batch_size": 8}


def fill_defaults(inner):
    """A dict of the InnerOptimizerConfig message with every zero field at its default."""
    fields = ("lr", "min_lr", "warmup_steps", "total_steps", "weight_decay", "beta1", "beta2",
              "eps", "grad_clip", "batch_size")
    c = {f: getattr(inner, f) for f in fields}
    for key, value in DEFAULTS.items():
        if not c[key]:
            c[key] = value
    if not c["min_lr"]:
        c["min_lr"] = c["lr"] / 10
    return c


def learning_rate(c, t):
    """eta_t for the data shard's step t (c as fill_defaults returns it)."""
    lr, min_lr, warmup, total = c["lr"], c["min_lr"], c["warmup_steps"], c["total_steps"]
    if t < warmup:
        return t * lr / warmup
    r = min(max((t - warmup) / max(total - warmup, 1), 0.0), 1.0)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * r))
