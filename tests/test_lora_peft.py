"""The independent check of LoRA (issue 33, section 3): Hugging Face `peft`'s LoRA on the same torch model and the
same weights computes what tfm_torch's (and so tfm_numpy's) computes: the outputs, the gradients of A and B, the
trainable parameters, and the merged weights. peft is a test-only dependency (pinned in pyproject's `test` extra).

peft adapts `torch.nn.Linear` layers; tfm_torch's `Linear` is its own module with the same `F.linear` forward, so the
reference model is the same GPT with each Linear swapped for an `nn.Linear` holding the same weights."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers_tracks import TOL, load_np_into_torch
from torch import nn

import tfm_numpy as tnp
import tfm_torch as tt

peft = pytest.importorskip("peft")

CFG = dict(vocab_size=40, d_model=16, n_heads=2, d_ff=32, n_layers=2, max_len=8)
TARGETS = ["q_proj", "v_proj", "linear1"]


def with_nn_linears(model: nn.Module) -> nn.Module:
    """A copy of `model` whose tfm_torch Linears are torch.nn.Linears with the same weights (what peft adapts)."""
    model = copy.deepcopy(model)
    for name, m in list(model.named_modules()):
        if type(m) is tt.Linear:
            ref = nn.Linear(m.in_features, m.out_features, m.bias is not None, dtype=m.weight.dtype)
            ref.load_state_dict(m.state_dict())
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, ref)
    return model


def pair(rank: int, alpha: float):
    """(tfm_torch GPT with add_lora, peft model) on the same base weights and the same (random, non-zero) A and B."""
    base = tt.GPT(**CFG, dtype=torch.float64)
    load_np_into_torch(tnp.GPT(**CFG, dtype=np.float64), base)
    ref = peft.get_peft_model(
        with_nn_linears(base),
        peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS, lora_dropout=0.0, bias="none"),
    )
    ours = copy.deepcopy(base)
    names = tt.add_lora(ours, rank, alpha, TARGETS, rng=0)
    rng = np.random.default_rng(1)
    with torch.no_grad():
        for n in names:
            layer, peft_layer = ours.get_submodule(n), ref.base_model.model.get_submodule(n)
            layer.lora_A.copy_(torch.from_numpy(rng.standard_normal(layer.lora_A.shape)))
            layer.lora_B.copy_(torch.from_numpy(rng.standard_normal(layer.lora_B.shape)))
            peft_layer.lora_A["default"].weight.copy_(layer.lora_A)
            peft_layer.lora_B["default"].weight.copy_(layer.lora_B)
    return ours, ref, names


@pytest.mark.parametrize("rank,alpha", [(2, 4.0), (4, 4.0), (1, 16.0)])
def test_outputs_and_adapter_gradients_equal_peft(rank, alpha):
    ours, ref, names = pair(rank, alpha)
    for n in names:  # peft's scaling is ours: alpha / rank
        assert ref.base_model.model.get_submodule(n).scaling["default"] == ours.get_submodule(n).scaling == alpha / rank
    ids = torch.from_numpy(np.random.default_rng(2).integers(0, CFG["vocab_size"], (2, 8)))
    g = torch.from_numpy(np.random.default_rng(3).standard_normal((2, 8, CFG["vocab_size"])))
    y, y_ref = ours(ids), ref(ids)
    assert (y - y_ref).abs().max().item() < TOL
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    for n in names:
        layer, peft_layer = ours.get_submodule(n), ref.base_model.model.get_submodule(n)
        assert (layer.lora_A.grad - peft_layer.lora_A["default"].weight.grad).abs().max().item() < TOL
        assert (layer.lora_B.grad - peft_layer.lora_B["default"].weight.grad).abs().max().item() < TOL
    # the same parameters train, and no others
    trainable_ref = sum(p.numel() for p in ref.parameters() if p.requires_grad)
    assert sum(p.numel() for p in tt.lora_parameters(ours)) == trainable_ref
    assert sum(p.numel() for p in ours.parameters() if p.requires_grad) == trainable_ref


def test_merge_equals_peft_merge_and_unload():
    ours, ref, names = pair(2, 8.0)
    merged_ref = ref.merge_and_unload()
    tt.merge_lora(ours)
    for n in names:
        assert (ours.get_submodule(n).weight - merged_ref.get_submodule(n).weight).abs().max().item() < 1e-12
    ids = torch.from_numpy(np.random.default_rng(4).integers(0, CFG["vocab_size"], (1, 8)))
    assert (ours(ids) - merged_ref(ids)).abs().max().item() < TOL


def test_a_is_drawn_from_the_same_range_as_peft_and_b_starts_at_zero():
    base = tt.GPT(**CFG, dtype=torch.float64)
    ref = peft.get_peft_model(with_nn_linears(base), peft.LoraConfig(r=4, lora_alpha=4, target_modules=["linear1"]))
    ours = copy.deepcopy(base)
    tt.add_lora(ours, 4, 4.0, ["linear1"], rng=0)
    a_ref = ref.base_model.model.layers[0].ff.linear1.lora_A["default"].weight
    a = ours.layers[0].ff.linear1.lora_A
    bound = 1 / np.sqrt(CFG["d_model"])  # kaiming_uniform(a=sqrt(5)), torch's Linear default: +-1/sqrt(in)
    assert a.abs().max().item() <= bound and a_ref.abs().max().item() <= bound
    assert a.abs().max().item() > 0.8 * bound and a_ref.abs().max().item() > 0.8 * bound
    assert (
        not ours.layers[0].ff.linear1.lora_B.any()
        and not ref.base_model.model.layers[0].ff.linear1.lora_B["default"].weight.any()
    )
