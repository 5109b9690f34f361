#!/usr/bin/python3
"""Where a training step of ALOE's built-in transformer spends the device's time.

Runs the inner step of aloe-worker (worker/trainer.cc) in PyTorch eager mode, which dispatches
to the same ATen kernels as LibTorch: forward under bf16 autocast, mean cross-entropy, backward,
the global gradient-norm clip, AdamW (torch.optim.AdamW, fused on a GPU where PyTorch has it,
as the trainer's worker/inner_adamw.h). The model is the aloe package's TransformerLM
(worker/python/aloe/model.py), the C++ model's function and parameters.

After warmup steps it records --steps steps with torch.profiler and prints:
  profile step_ms=<wall ms per step> tokens_per_second=<X> [mfu=<m>] device=<d>
  profile busy_ms=<kernel time per step> idle_fraction=<1 - busy / wall>
  profile category=<name> ms=<per step> share=<of kernel time> kernels=<launches per step>
  profile kernel=<name> ms=<per step> calls=<per step>        (the --top longest)
Categories: matmul (GEMM kernels), attention, optimizer (AdamW, clip and zeroing: multi-tensor
and fused kernels), softmax_ce (softmax and cross-entropy), norm (LayerNorm), copy (memcpy,
memset, dtype casts), elementwise (everything else). On the CPU the device's kernels are the CPU
operators (self time), in the same categories.

With --compile MODE (PyTorch 2.x) the forward pass and loss go through torch.compile: the
same profile then shows what kernel fusion, and with reduce-overhead CUDA graphs, would gain
over eager, an upper bound for doing the same by hand in LibTorch.

With --attention KERNEL the attention runs on that kernel alone (aloe-worker --attention).

scripts/gpu.sh check profile runs it on the GPU machine with the benchmark's 124M model.
"""

import argparse
import collections
import contextlib
import json
import os
import re
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "worker", "python"))

from aloe.model import TransformerLM  # noqa: E402

CATEGORIES = [
    ("optimizer", re.compile(r"multi_tensor|fused_adam|foreach|adam|lpnorm|zero_|clip", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|efficient", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|sm\d+_xmma|nvjet|cublas|matmul|addmm|\bmm\b|bmm|linear",
                          re.I)),
    ("softmax_ce", re.compile(r"softmax|nll_loss|cross_entropy|log_softmax", re.I)),
    ("norm", re.compile(r"layer_norm|layernorm", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy_|_to_copy|\bto\b|cat_|contiguous", re.I)),
]


# aloe-worker --attention's names for torch.nn.attention.SDPBackend's members.
ATTENTION = {"auto": None, "flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
             "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


def attention_kernel(name):
    """A context manager that lets attention use the kernel `name` alone; None where this PyTorch
    cannot choose (no torch.nn.attention, or no such kernel)."""
    if ATTENTION[name] is None:
        return contextlib.nullcontext()
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    backend = getattr(SDPBackend, ATTENTION[name], None)
    return None if backend is None else sdpa_kernel(backend)


def category(name):
    for label, pattern in CATEGORIES:
        if pattern.search(name):
            return label
    return "elementwise"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--vocab_size", type=int, default=24576)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--d_model", type=int, default=768)
    p.add_argument("--num_layers", type=int, default=12)
    p.add_argument("--num_heads", type=int, default=12)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--autocast", choices=["off", "bf16"], default="bf16")
    p.add_argument("--peak_tflops", type=float, default=0.0,
                   help="> 0 prints the model FLOPs utilisation (6 N + 12 L d T per token)")
    p.add_argument("--attention", default="auto", choices=sorted(ATTENTION),
                   help="the fused attention's kernel (torch.nn.attention.sdpa_kernel, PyTorch "
                        ">= 2.3), as aloe-worker --attention; auto: PyTorch's own choice")
    p.add_argument("--top", type=int, default=20, help="kernels listed by time")
    p.add_argument("--trace", default="", help="also keep the Chrome trace here")
    p.add_argument("--compile", default="off",
                   choices=["off", "default", "reduce-overhead", "max-autotune"],
                   help="run the forward and loss through torch.compile in this mode (PyTorch "
                        "2.x): what kernel fusion (and, with reduce-overhead, CUDA graphs) "
                        "would gain over eager")
    args = p.parse_args(argv)
    for name in ("seq_len", "d_model", "num_layers", "num_heads", "batch_size", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.d_model % args.num_heads:
        p.error("--num_heads must divide --d_model")
    return args


class Config:
    def __init__(self, args):
        self.vocab_size = args.vocab_size
        self.seq_len = args.seq_len
        self.d_model = args.d_model
        self.num_layers = args.num_layers
        self.num_heads = args.num_heads
        self.ffn_mult = 4


def flops_per_token(model, args):
    """6 N + 12 L d T: N counts the matrix products' parameters (all but the embeddings)."""
    n = sum(p.numel() for name, p in model.named_parameters() if "emb" not in name)
    return 6 * n + 12 * args.num_layers * args.d_model * args.seq_len


def make_step(model, args, device):
    loss_of = model.loss
    attention = args.attention
    if args.compile != "off":
        loss_of = torch.compile(model.loss, mode=args.compile)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    extra = {}
    if device.type == "cuda" and "fused" in torch.optim.AdamW.__init__.__code__.co_varnames:
        extra["fused"] = True
    optimizer = torch.optim.AdamW(groups, lr=4e-4, betas=(0.9, 0.95), eps=1e-8, **extra)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (1 << 20,), generator=generator)
    window = args.seq_len + 1

    def step():
        starts = torch.randint(0, tokens.numel() - window, (args.batch_size,), generator=generator)
        batch = torch.stack([tokens[s:s + window] for s in starts.tolist()])
        if device.type == "cuda":
            batch = batch.pin_memory().to(device, non_blocking=True)
        # As the trainer: gradients dropped on a GPU, zeroed in place on the CPU.
        optimizer.zero_grad(set_to_none=device.type == "cuda")
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.autocast == "bf16"), \
                attention_kernel(attention):
            loss = loss_of(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.detach()

    return step, ("fused" if extra else "default")


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_events(trace, on_gpu):
    """(name, microseconds) of the device's work in a Chrome trace: kernels, copies and sets on
    a GPU; the CPU operators' self time on the CPU."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    out = []
    if on_gpu:
        for e in events:
            if e.get("ph") == "X" and e.get("cat", "").lower() in (
                    "kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime_kernel"):
                out.append((e.get("name", "?"), float(e.get("dur", 0))))
        return out
    # CPU: self time = duration less that of the operators nested in it on the same thread.
    # Kineto names them cpu_op; the legacy profiler (a PyTorch built without Kineto) no category.
    ops = [e for e in events
           if e.get("ph") == "X" and e.get("cat", "cpu_op").lower() in ("cpu_op", "operator")]
    ops.sort(key=lambda e: (e.get("tid"), float(e["ts"]), -float(e.get("dur", 0))))
    stack = []
    self_us = {}
    for e in ops:
        start, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))
        while stack and (stack[-1][1] <= start or stack[-1][2] != e.get("tid")):
            stack.pop()
        key = id(e)
        self_us[key] = float(e.get("dur", 0))
        if stack:
            self_us[stack[-1][3]] -= float(e.get("dur", 0))
        stack.append((start, end, e.get("tid"), key))
    return [(e.get("name", "?"), max(self_us[id(e)], 0.0)) for e in ops]


def main(argv):
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.compile != "off" and not hasattr(torch, "compile"):
        print(f"gpu-profile: --compile needs PyTorch 2.x; this is {torch.__version__}",
              file=sys.stderr)
        return 2
    if attention_kernel(args.attention) is None:
        print(f"gpu-profile: --attention {args.attention} needs torch.nn.attention (PyTorch >= "
              f"2.3) with that kernel; this is {torch.__version__}", file=sys.stderr)
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"gpu-profile: {args.device}: PyTorch sees no CUDA GPU", file=sys.stderr)
        return 1
    torch.manual_seed(1)
    model = TransformerLM(Config(args)).to(device)
    step, optimizer_kind = make_step(model, args, device)
    for i in range(args.warmup):
        step()
        print(f"gpu-profile: warmup step {i + 1}/{args.warmup}", file=sys.stderr)
    synchronize(device)
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    losses = []
    with profile(activities=activities) as prof:
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            losses.append(step())
        synchronize(device)
        wall = (time.perf_counter() - t0) / args.steps
    with tempfile.TemporaryDirectory() as tmp:
        path = args.trace or os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    events = device_events(trace, device.type == "cuda")
    if not events:
        print("gpu-profile: the profiler recorded no device work", file=sys.stderr)
        return 1
    loss = float(torch.stack(losses).float().mean())
    tokens = args.batch_size * args.seq_len
    tps = tokens / wall
    line = (f"profile step_ms={1e3 * wall:.2f} tokens_per_second={tps:.1f} loss={loss:.4f} "
            f"adamw={optimizer_kind} compile={args.compile} attention={args.attention} "
            f"device={device}")
    if args.peak_tflops > 0:
        line += f" mfu={tps * flops_per_token(model, args) / (args.peak_tflops * 1e12):.3f}"
    print(line)
    busy = sum(us for _, us in events) / args.steps / 1e3
    print(f"profile busy_ms={busy:.2f} idle_fraction={max(0.0, 1 - busy / (1e3 * wall)):.3f}")
    by_category = collections.defaultdict(lambda: [0.0, 0])
    by_kernel = collections.defaultdict(lambda: [0.0, 0])
    for name, us in events:
        for table, key in ((by_category, category(name)), (by_kernel, name)):
            table[key][0] += us
            table[key][1] += 1
    total = sum(v[0] for v in by_category.values())
    for name, (us, n) in sorted(by_category.items(), key=lambda kv: -kv[1][0]):
        print(f"profile category={name} ms={us / args.steps / 1e3:.3f} share={us / total:.3f} "
              f"kernels={n / args.steps:.0f}")
    for name, (us, n) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:args.top]:
        short = re.sub(r"\s+", " ", name)[:120]
        print(f"profile kernel={short!r} ms={us / args.steps / 1e3:.3f} calls={n / args.steps:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
