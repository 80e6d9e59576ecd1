"""The trainer's GPU paths (bf16 autocast, fused AdamW, grouped MoE, FlexAttention in the model) compiled
and eager: the same losses over a few steps. Run on a CUDA machine: ``pytest -m gpu tests/test_training_gpu.py``."""
import pytest
import torch

from configs import load_config
from helpers import tiny_overrides
from training.loop import Trainer

pytestmark = pytest.mark.gpu

# Big enough for the GPU paths: bf16 grouped GEMMs need 16-byte-aligned dims; flex runs above the crossover.
GPU_SIZES = {"model.dim": 256, "model.n_heads": 4, "model.n_kv_heads": 2, "model.ffn_hidden": 512,
             "train.device": "cuda", "train.batch_size": 2}
CASES = {
    "moe": ("zoo/tiny_moe.yaml", {"model.moe.hidden_dim": 256, "train.seq_len": 256, "model.max_seq_len": 256}),
    "moe_shared_first_dense": ("zoo/deepseek_moe_16b.yaml", {
        "model.moe.hidden_dim": 128, "model.moe.num_experts": 16, "model.moe.top_k": 4, "model.n_layers": 3,
        "train.seq_len": 256, "model.max_seq_len": 256}),
    # the long-context preset's per-head patterns (A-shape, GQA-shared block top-k) on a small backbone
    "sparse_attention": ("zoo/sparse_attn_1b_64k.yaml", {
        "model.n_layers": 16, "model.n_heads": 16, "model.n_kv_heads": 4, "train.seq_len": 8192,
        "model.max_seq_len": 8192, "train.batch_size": 1, "eval.passkey_lengths": "[]"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_training_steps_equal_eager_on_cuda(tmp_path, corpus_dir, case):
    preset, extra = CASES[case]

    def trainer(sub, compile_):
        ov = tiny_overrides(tmp_path / sub, corpus_dir, **{**GPU_SIZES, **extra, "train.compile": compile_})
        return Trainer(load_config(preset, ov))

    eager, compiled = trainer("e", False), trainer("c", True)
    for step in range(3):
        a, b = eager.train_step(), compiled.train_step()
        assert not a["skipped"] and not b["skipped"], (step, a, b)
        # bf16 autocast: the compiled graph rounds differently; a broken graph is off by far more.
        torch.testing.assert_close(b["loss/total"].float(), a["loss/total"].float(), rtol=2e-2, atol=2e-2)
    torch.cuda.synchronize()
