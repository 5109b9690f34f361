#!/usr/bin/env python3
"""A model in and out of ALOE as safetensors, read and written by independent code (json + numpy).

Usage: safetensors_round_trip_test.py BIN_DIR

1. Writes init.safetensors with numpy: every tensor of a small built-in transformer under its
   GPT-2-style (nanoGPT) name, half of them float32 and half bfloat16.
2. Starts aloe-server with init_file pointing at it and no workers; it stops after a second and
   writes its checkpoint of version 0.
   While it runs, aloe-export --server writes its live model as live.safetensors.
3. aloe-export writes that checkpoint as out.safetensors and config.json.
4. Reads out.safetensors and live.safetensors with json + numpy and compares every tensor, bit
   for bit, with what step 1 wrote; checks config.json.
5. Files that do not fit (a tensor missing, one reshaped, a truncated file) stop the server at
   start, naming the tensor or the byte offset.
"""
import json
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

D, LAYERS, VOCAB, SEQ, FFN = 16, 2, 256, 8, 64


def model_shapes():
    shapes = {"transformer.wte.weight": (VOCAB, D), "transformer.wpe.weight": (SEQ, D)}
    for i in range(LAYERS):
        p = f"transformer.h.{i}."
        shapes.update({
            p + "ln_1.weight": (D,), p + "ln_1.bias": (D,),
            p + "attn.c_attn.weight": (3 * D, D), p + "attn.c_attn.bias": (3 * D,),
            p + "attn.c_proj.weight": (D, D), p + "attn.c_proj.bias": (D,),
            p + "ln_2.weight": (D,), p + "ln_2.bias": (D,),
            p + "mlp.c_fc.weight": (FFN, D), p + "mlp.c_fc.bias": (FFN,),
            p + "mlp.c_proj.weight": (D, FFN), p + "mlp.c_proj.bias": (D,),
        })
    shapes.update({"transformer.ln_f.weight": (D,), "transformer.ln_f.bias": (D,),
                   "lm_head.weight": (VOCAB, D)})
    return shapes


def write_safetensors(path, tensors, dtypes):
    """tensors: name -> float32 array; dtypes: name -> "F32" or "BF16"."""
    header, blobs, offset = {}, [], 0
    for name, values in tensors.items():
        if dtypes[name] == "BF16":
            data = (values.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()
        else:
            data = values.astype("<f4").tobytes()
        header[name] = {"dtype": dtypes[name], "shape": list(values.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def read_safetensors(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    metadata = header.pop("__metadata__", {})
    data = raw[8 + n:]
    out = {}
    for name, e in header.items():
        assert e["dtype"] == "F32", (name, e["dtype"])
        begin, end = e["data_offsets"]
        out[name] = np.frombuffer(data[begin:end], dtype="<f4").reshape(e["shape"])
    return out, metadata


def run_server(bin_dir, work, config_text, tag, while_live=None):
    """Starts aloe-server on `config_text`; once it listens, calls while_live(grpc port) when
    given, then SIGTERM makes it write its final checkpoint and exit. Returns (exit code, its
    log)."""
    config = work / f"{tag}.textproto"
    config.write_text(config_text)
    ports = work / f"{tag}.ports"
    log = work / f"{tag}.log"
    with open(log, "w") as out:
        server = subprocess.Popen([str(bin_dir / "aloe-server"), f"--config={config}",
                                   f"--port_file={ports}", "--drain_seconds=0"],
                                  stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while server.poll() is None and not ports.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if server.poll() is None:
            if while_live is not None:
                time.sleep(0.1)  # the port file is complete
                port = dict(kv.split("=") for kv in ports.read_text().split())["grpc"]
                while_live(int(port))
            server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            code = server.wait()
    return code, log.read_text()


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    bin_dir = Path(sys.argv[1]).resolve()
    failures = []

    def check(ok, what):
        print(("ok   " if ok else "FAIL ") + what)
        if not ok:
            failures.append(what)

    with tempfile.TemporaryDirectory(prefix="aloe_safetensors_") as tmp:
        work = Path(tmp)
        (work / "text").mkdir()
        (work / "text" / "a.txt").write_text("It was the best of times, it was the worst. " * 80)
        subprocess.run([str(bin_dir / "aloe-corpus"), f"--input_dir={work / 'text'}",
                        f"--output_dir={work / 'corpus'}", "--heldout_fraction=0.2"],
                       check=True, capture_output=True, timeout=60)
        rng = np.random.default_rng(7)
        shapes = model_shapes()
        # bfloat16 keeps the top 16 bits: values that have only those round-trip exactly.
        tensors = {name: (rng.standard_normal(shape).astype("<f4").view("<u4")
                          & np.uint32(0xFFFF0000)).view("<f4")
                   for name, shape in shapes.items()}
        dtypes = {name: ("BF16" if i % 2 else "F32") for i, name in enumerate(tensors)}
        write_safetensors(work / "init.safetensors", tensors, dtypes)

        def config(init_file):
            return textwrap.dedent(f"""\
                corpus_dir: "{work / 'corpus'}"
                model {{ vocab_size: {VOCAB} seq_len: {SEQ} d_model: {D} num_layers: {LAYERS}
                        num_heads: 2 ffn_mult: {FFN // D} }}
                init_file: "{init_file}"
                checkpoint {{ dir: "{work / 'ckpt'}" }}
                """)

        live = {}

        def export_live(port):
            live["run"] = subprocess.run(
                [str(bin_dir / "aloe-export"), f"--server=127.0.0.1:{port}",
                 f"--out={work / 'live.safetensors'}"],
                capture_output=True, text=True, timeout=60)

        code, log = run_server(bin_dir, work, config(work / "init.safetensors"), "server",
                               export_live)
        check(code == 0, "server started from init.safetensors and checkpointed version 0"
              + ("" if code == 0 else f" ({log[-300:]})"))
        out = subprocess.run([str(bin_dir / "aloe-export"), f"--config={work / 'server.textproto'}",
                              f"--checkpoint={work / 'ckpt'}", f"--out={work / 'out.safetensors'}",
                              f"--config_json={work / 'config.json'}"],
                             capture_output=True, text=True, timeout=60)
        check(out.returncode == 0 and "exported version 0" in out.stdout,
              f"aloe-export ({out.stdout.strip()} {out.stderr[-300:]})")
        if out.returncode == 0:
            exported, metadata = read_safetensors(work / "out.safetensors")
            check(sorted(exported) == sorted(tensors), f"the same {len(tensors)} tensor names")
            same = [name for name in tensors if name in exported
                    and exported[name].shape == tensors[name].shape
                    and exported[name].tobytes() == tensors[name].tobytes()]
            check(len(same) == len(tensors),
                  f"{len(same)} of {len(tensors)} tensors bit-identical (F32 and BF16 inputs)")
            check(metadata.get("aloe_version") == "0", f"metadata {metadata}")
            cfg = json.loads((work / "config.json").read_text())
            check((cfg["n_layer"], cfg["n_embd"], cfg["n_head"], cfg["vocab_size"],
                   cfg["block_size"]) == (LAYERS, D, 2, VOCAB, SEQ), f"config.json {cfg}")
        run = live.get("run")
        said = "" if run is None else f" ({run.stdout.strip()} {run.stderr[-300:]})"
        check(run is not None and run.returncode == 0 and "exported version 0" in run.stdout,
              "aloe-export --server" + said)
        if run is not None and run.returncode == 0:
            exported, metadata = read_safetensors(work / "live.safetensors")
            same = [name for name in tensors if name in exported
                    and exported[name].tobytes() == tensors[name].tobytes()]
            check(sorted(exported) == sorted(tensors) and len(same) == len(tensors),
                  f"the live model: {len(same)} of {len(tensors)} tensors bit-identical")

        # Files that do not fit the model stop the server at start, naming what is wrong.
        missing = dict(tensors)
        del missing["transformer.h.1.mlp.c_fc.bias"]
        write_safetensors(work / "missing.safetensors", missing, dtypes)
        reshaped = dict(tensors)
        reshaped["lm_head.weight"] = reshaped["lm_head.weight"].T.copy()
        write_safetensors(work / "reshaped.safetensors", reshaped, dtypes)
        whole = (work / "init.safetensors").read_bytes()
        (work / "truncated.safetensors").write_bytes(whole[:len(whole) - 100])
        for tag, expect in [("missing", "no tensor blocks.1.mlp.fc1.bias (or "
                                        "transformer.h.1.mlp.c_fc.bias)"),
                            ("reshaped", "lm_head.weight has shape [16, 256], the model [256, 16]"),
                            ("truncated", "truncated: tensor lm_head.weight ends at byte")]:
            code, log = run_server(bin_dir, work, config(work / f"{tag}.safetensors"), tag)
            check(code != 0 and expect in log,
                  f"{tag} file refused: {expect!r} ({log.strip()[-200:]})")

    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
