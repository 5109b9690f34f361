#!/usr/bin/python3
"""Unit tests of the Python worker package (worker/python/aloe), without a server: its push
codecs byte for byte against the C++ encoder (aloe-codec-golden), the inner LR schedule's golden
values, bring-your-own model fingerprints against aloe-import-model, the token file readers
(malformed files refused naming file and offset), and the built-in transformer's parameters.

Usage: python_worker_unit_test.py [--bin-dir build/bin] [unittest args]
"""

import atexit
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN_DIR = os.path.join(ROOT, "build", "bin")
sys.path.insert(0, os.path.join(ROOT, "worker", "python"))
sys.path.insert(0, os.path.join(ROOT, "tests", "testing"))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))

CACHE = tempfile.mkdtemp(prefix="aloe-pyproto-")
atexit.register(shutil.rmtree, CACHE, True)
os.environ.setdefault("ALOE_CACHE_DIR", CACHE)

import aloe  # noqa: E402
import unittest_main  # noqa: E402
from aloe import codec, data, schedule  # noqa: E402
from aloe._proto import config_pb2, model_pb2  # noqa: E402


def cpp_encode(name, values, block_size):
    """(payload, residual) from the C++ encoder."""
    values = np.ascontiguousarray(values, dtype="<f4")
    run = subprocess.run([os.path.join(BIN_DIR, "aloe-codec-golden"), name, str(block_size)],
                         input=values.tobytes(), capture_output=True, check=True)
    split = len(run.stdout) - 4 * values.size
    return run.stdout[:split], np.frombuffer(run.stdout[split:], "<f4")


def edge_values():
    rng = np.random.default_rng(7)
    f32 = np.float32
    tiny = np.array([1e-45, -3e-44, 1.1754942e-38, 5e-40, -1e-39, 0.0, 2e-38, 1e-37],
                    dtype=f32)  # a block with max |x| below 127 * 2^-126: the subnormal rule
    ties = (np.arange(-8, 8, dtype=f32) + f32(0.5)) / f32(127)  # levels at .5 before rounding
    big = np.array([3.4e38, -3.4028235e38, 3.3961e38, 1.0, -2.5], dtype=f32)
    bf16_edges = np.array([1.00390625, 1.01171875, -1.00390625, 3.3961e38, -3.39619e38,
                           np.float32(2.0 ** -130), 65504.0], dtype=f32)
    return {
        "normal": rng.standard_normal(3001).astype(f32),
        "scaled": (rng.standard_normal(1000) * 1e-5).astype(f32),
        "ties": ties,
        "tiny": tiny,
        "flt_max": big,
        "bf16_edges": bf16_edges,
        "zeros": np.zeros(300, dtype=f32),
        "one": np.array([-0.75], dtype=f32),
    }


class CodecTest(unittest.TestCase):
    def test_bytes_equal_the_cpp_encoder(self):
        for label, values in edge_values().items():
            for name, sizes in (("fp32", [0]), ("bf16", [0]), ("int8", [1, 7, 256])):
                for block in sizes:
                    with self.subTest(values=label, codec=name, block=block):
                        want, want_residual = cpp_encode(name, values, block)
                        got, residual = codec.encode(codec.NAMES[name], values, block or 256)
                        self.assertEqual(got, want)
                        np.testing.assert_array_equal(np.asarray(residual, "<f4"),
                                                      want_residual)

    def test_decoders_invert_the_encoders(self):
        values = edge_values()["normal"]
        payload, residual = codec.encode_int8(values, 64)
        np.testing.assert_array_equal(codec.decode_int8(payload) + residual, values)
        payload, residual = codec.encode_bf16(values)
        np.testing.assert_array_equal(codec.decode_bf16(payload) + residual, values)

    def test_non_finite_values_are_refused_naming_the_element(self):
        values = np.ones(10, dtype=np.float32)
        values[6] = np.nan
        for name in ("fp32", "bf16", "int8"):
            with self.assertRaisesRegex(codec.CodecError, r"x\[6\] is nan"):
                codec.encode(codec.NAMES[name], values)

    def test_chunks_stay_under_a_mebibyte_and_cover_the_layer(self):
        values = np.random.default_rng(3).standard_normal(1_200_000).astype(np.float32)
        for name, block in (("fp32", 0), ("bf16", 0), ("int8", 256), ("int8", 3)):
            c = codec.NAMES[name]
            parts = list(codec.chunks(c, values, block or 256))
            self.assertGreater(len(parts), 1)
            offsets = [offset for offset, _, _ in parts]
            step = codec.max_chunk_elements(c, block or 256)
            self.assertEqual(offsets, list(range(0, values.size, step)))
            for _, payload, _ in parts:
                self.assertLessEqual(len(payload), codec.MAX_CHUNK_BYTES)
        # int8: whole blocks of 256 values (1 byte each + a 4-byte scale) after a 16-byte header.
        self.assertEqual(codec.max_chunk_elements(codec.INT8, 256),
                         (((1 << 20) - 1024 - 16) // 260) * 256)

    def test_unsupported_codecs_are_named(self):
        with self.assertRaisesRegex(codec.CodecError, "CODEC_LOWRANK"):
            codec.encode(codec.LOWRANK, np.ones(4, np.float32))


class ScheduleTest(unittest.TestCase):
    def test_warmup_then_cosine(self):
        inner = config_pb2.InnerOptimizerConfig(lr=0.002, min_lr=0.0002, warmup_steps=20,
                                                total_steps=2020)
        c = schedule.fill_defaults(inner)
        lr = float(np.float32(0.002))
        min_lr = float(np.float32(0.0002))
        self.assertAlmostEqual(schedule.learning_rate(c, 0), 0.0, places=12)
        self.assertAlmostEqual(schedule.learning_rate(c, 10), lr / 2, places=12)
        self.assertAlmostEqual(schedule.learning_rate(c, 20), lr, places=12)
        # Half way through the cosine: (lr + min_lr) / 2.
        self.assertAlmostEqual(schedule.learning_rate(c, 1020), (lr + min_lr) / 2, places=12)
        self.assertAlmostEqual(schedule.learning_rate(c, 520),
                               min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi / 4)),
                               places=12)
        self.assertAlmostEqual(schedule.learning_rate(c, 5000), min_lr, places=12)

    def test_defaults(self):
        c = schedule.fill_defaults(config_pb2.InnerOptimizerConfig())
        self.assertAlmostEqual(c["lr"], 3e-3)
        self.assertAlmostEqual(c["min_lr"], 3e-4)
        self.assertEqual((c["warmup_steps"], c["total_steps"], c["batch_size"]), (50, 10000, 8))
        self.assertAlmostEqual(c["grad_clip"], 1.0)
        self.assertAlmostEqual(c["beta2"], 0.95)


class FingerprintTest(unittest.TestCase):
    def test_equals_aloe_import_model(self):
        import make_torchscript_models as models
        with tempfile.TemporaryDirectory() as tmp:
            for module, output in ((models.LogitsLM(), "logits"), (models.LossLM(), "loss")):
                pt = os.path.join(tmp, output + ".pt")
                torch.jit.script(module).save(pt)
                out = os.path.join(tmp, output + ".aloemodel")
                subprocess.run([os.path.join(BIN_DIR, "aloe-import-model"),
                                "--torchscript=" + pt, "--out=" + out, "--vocab_size=256",
                                "--seq_len=32"], check=True, capture_output=True)
                with open(out, "rb") as f:
                    raw = f.read()
                self.assertEqual(raw[:8], b"ALOEMODL")
                imported = model_pb2.ImportedModel.FromString(raw[8:])
                with self.subTest(output=output):
                    self.assertEqual(aloe.model_fingerprint(module, output),
                                     imported.fingerprint)
                    other = "loss" if output == "logits" else "logits"
                    self.assertNotEqual(aloe.model_fingerprint(module, other),
                                        imported.fingerprint)

    def test_layer_grouping(self):
        self.assertEqual(aloe.layer_name_of("blocks.3.attn.qkv.weight"), "blocks.3")
        self.assertEqual(aloe.layer_name_of("tok_emb.weight"), "tok_emb")
        self.assertEqual(aloe.layer_name_of("pos"), "root")
        self.assertEqual(aloe.layer_name_of("head.7"), "head")


class TokenFileTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)

    def write(self, name, payload):
        path = os.path.join(self.tmp.name, name)
        with open(path, "wb") as f:
            f.write(payload)
        return path

    def test_reads_the_three_formats(self):
        tokens = np.array([5, 0, 255, 1000, 7], dtype="<u2")
        aloe_file = self.write("a.tok", b"ALOETOKS" + struct.pack("<IIQII", 1, 2, 5, 1001, 0) +
                               tokens.tobytes())
        header = np.zeros(256, "<i4")
        header[:3] = (20240520, 1, 5)
        llmc = self.write("b.bin", header.tobytes() + tokens.tobytes())
        nano = self.write("c.bin", tokens.tobytes())
        np.testing.assert_array_equal(data.open_token_file(aloe_file, "aloe"), tokens)
        np.testing.assert_array_equal(data.open_token_file(llmc, "llmc", 50257), tokens)
        np.testing.assert_array_equal(data.open_token_file(nano, "uint16", 50257), tokens)

    def test_malformed_files_are_refused_naming_file_and_offset(self):
        tokens = np.arange(5, dtype="<u2").tobytes()
        truncated = self.write("t.tok", b"ALOETOKS" + struct.pack("<IIQII", 1, 2, 6, 300, 0) +
                               tokens)
        with self.assertRaisesRegex(data.DataError, r"t\.tok: offset 42: .* header says 44"):
            data.open_token_file(truncated, "aloe")
        magic = self.write("m.tok", b"ALOETOKZ" + bytes(24))
        with self.assertRaisesRegex(data.DataError, r"m\.tok: offset 0: bad magic"):
            data.open_token_file(magic, "aloe")
        odd = self.write("o.bin", b"\x01\x02\x03")
        with self.assertRaisesRegex(data.DataError, r"o\.bin: offset 3"):
            data.open_token_file(odd, "uint16")
        header = np.zeros(256, "<i4")
        header[:3] = (20240519, 1, 2)
        wrong = self.write("w.bin", header.tobytes() + tokens[:4])
        with self.assertRaisesRegex(data.DataError, r"w\.bin: offset 0: not an llm\.c"):
            data.open_token_file(wrong, "llmc")
        with self.assertRaisesRegex(data.DataError, r"missing\.tok: No such file"):
            data.open_token_file(os.path.join(self.tmp.name, "missing.tok"), "aloe")

    def test_batches_are_windows_of_the_file(self):
        tokens = np.arange(100, dtype="<u2")
        batch = data.sample_batch(tokens, 6, 9, np.random.default_rng(1))
        self.assertEqual(tuple(batch.shape), (6, 10))
        self.assertEqual(batch.dtype, torch.int64)
        for row in batch.tolist():  # consecutive tokens, inside the file
            self.assertEqual(row, list(range(row[0], row[0] + 10)))
            self.assertLessEqual(row[-1], 99)
        with self.assertRaisesRegex(data.DataError, "no window of 101"):
            data.sample_batch(tokens, 1, 100, np.random.default_rng(1))


class TransformerTest(unittest.TestCase):
    def test_parameters_are_the_spec_tensors_in_order(self):
        config = config_pb2.TransformerConfig(vocab_size=11, seq_len=6, d_model=8, num_layers=2,
                                              num_heads=2, ffn_mult=4)
        model = aloe.TransformerLM(config)
        block = ["ln1.weight", "ln1.bias", "attn.qkv.weight", "attn.qkv.bias",
                 "attn.proj.weight", "attn.proj.bias", "ln2.weight", "ln2.bias",
                 "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias"]
        want = (["tok_emb.weight", "pos_emb.weight"] +
                ["blocks.%d.%s" % (i, n) for i in range(2) for n in block] +
                ["ln_f.weight", "ln_f.bias", "head.weight"])
        self.assertEqual([n for n, _ in model.named_parameters()], want)
        shapes = dict((n, tuple(p.shape)) for n, p in model.named_parameters())
        self.assertEqual(shapes["blocks.1.attn.qkv.weight"], (24, 8))
        self.assertEqual(shapes["blocks.0.mlp.fc1.weight"], (32, 8))
        self.assertEqual(shapes["head.weight"], (11, 8))

    def test_attention_is_causal(self):
        config = config_pb2.TransformerConfig(vocab_size=11, seq_len=6, d_model=8, num_layers=1,
                                              num_heads=2, ffn_mult=4)
        torch.manual_seed(0)
        model = aloe.TransformerLM(config)
        a = torch.tensor([[1, 2, 3, 4, 5, 6]])
        b = torch.tensor([[1, 2, 3, 9, 9, 9]])
        with torch.no_grad():
            torch.testing.assert_close(model(a)[:, :3], model(b)[:, :3])
            self.assertFalse(torch.allclose(model(a)[:, 3:], model(b)[:, 3:]))


def set_bin_dir(path):
    global BIN_DIR
    BIN_DIR = path


if __name__ == "__main__":
    unittest_main.main(set_bin_dir)
