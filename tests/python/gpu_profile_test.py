#!/usr/bin/python3
"""scripts/gpu-profile.py on the CPU with a small model: the step is timed, every recorded
operator lands in one category, the categories add up to the busy time, and the optimizer's
work is found (the GPU run, scripts/gpu.sh check profile, reads the same lines).

Usage: gpu_profile_test.py [unittest args]
"""

import contextlib
import importlib.util
import io
import os
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEC = importlib.util.spec_from_file_location("gpu_profile",
                                              os.path.join(ROOT, "scripts", "gpu-profile.py"))
gpu_profile = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(gpu_profile)


def fields(line):
    return dict(kv.split("=", 1) for kv in line.split()[1:])


class GpuProfileTest(unittest.TestCase):
    def test_a_cpu_profile_accounts_for_the_step(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            rc = gpu_profile.main(["--device", "cpu", "--vocab_size", "128", "--seq_len", "32",
                                   "--d_model", "32", "--num_layers", "2", "--num_heads", "2",
                                   "--batch_size", "2", "--warmup", "1", "--steps", "2",
                                   "--peak_tflops", "0.001", "--top", "5"])
        self.assertEqual(rc, 0)
        lines = out.getvalue().splitlines()
        head = fields(lines[0])
        self.assertGreater(float(head["step_ms"]), 0)
        self.assertAlmostEqual(float(head["tokens_per_second"]),
                               2 * 32 / (float(head["step_ms"]) / 1e3), delta=0.01 * 2000)
        # 6 N + 12 L d T by hand: per block qkv 32*96+96, proj 32*32+32, fc1 32*128+128,
        # fc2 128*32+32, two LayerNorms 2*64: 12704; two blocks, the head 32*128, ln_f 64.
        n = 2 * 12704 + 32 * 128 + 64
        flops = 6 * n + 12 * 2 * 32 * 32
        self.assertEqual(gpu_profile.flops_per_token(
            gpu_profile.TransformerLM(gpu_profile.Config(gpu_profile.parse_args(
                ["--vocab_size", "128", "--seq_len", "32", "--d_model", "32", "--num_layers",
                 "2", "--num_heads", "2"]))),
            gpu_profile.parse_args(["--seq_len", "32", "--d_model", "32", "--num_layers", "2",
                                    "--num_heads", "2"])), flops)
        self.assertAlmostEqual(float(head["mfu"]),
                               float(head["tokens_per_second"]) * flops / 1e9, delta=0.0011)
        busy = float(fields(lines[1])["busy_ms"])
        categories = {fields(x)["category"]: fields(x) for x in lines if "category=" in x}
        self.assertAlmostEqual(sum(float(c["ms"]) for c in categories.values()), busy,
                               delta=0.01 * busy + 0.01)
        self.assertAlmostEqual(sum(float(c["share"]) for c in categories.values()), 1.0,
                               delta=0.01)
        for name in ("matmul", "optimizer", "softmax_ce"):
            self.assertIn(name, categories)
            self.assertGreater(float(categories[name]["ms"]), 0, name)
        self.assertEqual(len([x for x in lines if x.startswith("profile kernel=")]), 5)

    def test_compile_without_pytorch_2_is_refused_by_name(self):
        if hasattr(gpu_profile.torch, "compile"):
            self.skipTest("this PyTorch has torch.compile")
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = gpu_profile.main(["--device", "cpu", "--compile", "default"])
        self.assertEqual(rc, 2)
        self.assertIn("--compile needs PyTorch 2.x", err.getvalue())

    def test_the_attention_kernel_is_chosen_or_refused_by_name(self):
        small = ["--device", "cpu", "--vocab_size", "128", "--seq_len", "32", "--d_model", "32",
                 "--num_layers", "2", "--num_heads", "2", "--batch_size", "2", "--warmup", "1",
                 "--steps", "1", "--attention", "math"]
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = gpu_profile.main(small)
        if gpu_profile.attention_kernel("math") is None:  # no torch.nn.attention
            self.assertEqual(rc, 2)
            self.assertIn("--attention math needs torch.nn.attention", err.getvalue())
            return
        self.assertEqual(rc, 0, err.getvalue())
        self.assertEqual(fields(out.getvalue().splitlines()[0])["attention"], "math")

    def test_categories_of_cuda_kernel_names(self):
        for name, want in [
                ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
                ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT", "matmul"),
                ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>",
                 "attention"),
                ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64",
                 "attention"),
                ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80", "attention"),
                ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<"
                 "FusedAdamMathFunctor<float, 4>>", "optimizer"),
                ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>",
                 "softmax_ce"),
                ("void at::native::vectorized_layer_norm_kernel<float, float>", "norm"),
                ("Memcpy HtoD (Pinned -> Device)", "copy"),
                ("void at::native::vectorized_elementwise_kernel<4, GeluCUDAKernelImpl>",
                 "elementwise")]:
            self.assertEqual(gpu_profile.category(name), want, name)


if __name__ == "__main__":
    unittest.main()
