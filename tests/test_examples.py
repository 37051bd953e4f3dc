"""Fast checks of the example models: eager semantics, mask handling, and torch.export capture."""

import fnmatch
import resource
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from examples.models import (
    FACTORIES, factory, gpt2_tiny, init_weights, llama_8b_meta, llama_tiny,
)

TINY = {
    "llama": lambda **kw: llama_tiny(**kw),
    "llama_tied": lambda **kw: llama_tiny(tie_embeddings=True, **kw),
    "gpt2": lambda **kw: gpt2_tiny(**kw),
}


def _export(model, args):
    return torch.export.export(model, args, strict=False)


@pytest.mark.parametrize("name", sorted(TINY))
def test_forward_backward(name):
    model, args, _ = TINY[name]()
    logits = model(*args)
    cfg = model.config
    assert logits.shape == (*args[0].shape, cfg.vocab_size)
    assert torch.isfinite(logits).all()

    model, args, _ = TINY[name](with_labels=True)
    loss = model(*args)
    assert loss.dim() == 0 and torch.isfinite(loss)
    # Random init over 64 tokens: the loss sits near log(64), not at 0 or inf.
    assert 2.0 < loss.item() < 8.0
    loss.backward()
    for fqn, p in model.named_parameters():
        assert p.grad is not None, fqn
        assert torch.isfinite(p.grad).all(), fqn
        assert p.grad.abs().sum() > 0, fqn


def test_loss_is_shifted_mean_cross_entropy_ignoring_padding():
    model, (ids, mask, labels), _ = llama_tiny(with_mask=True, with_labels=True)
    assert (labels == -100).sum() == (mask == 0).sum() > 0
    logits = model(ids, mask)
    want = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                           ignore_index=-100)
    torch.testing.assert_close(model(ids, mask, labels), want)


def test_tied_embeddings_share_one_parameter():
    model, _, dims = llama_tiny(tie_embeddings=True)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert "lm_head.weight" not in dims
    gpt, _, gdims = gpt2_tiny()
    assert gpt.lm_head.weight is gpt.wte.weight
    assert "lm_head.weight" not in gdims


def test_all_ones_mask_matches_causal_path():
    model, (ids,), _ = llama_tiny()
    torch.testing.assert_close(model(ids, torch.ones_like(ids)), model(ids), rtol=0, atol=1e-6)


def test_left_padding_changes_only_padded_rows():
    model, (ids,), _ = llama_tiny()
    pads = [0, 1, 3, 0]
    mask = torch.ones_like(ids)
    for r, p in enumerate(pads):
        mask[r, :p] = 0
    padded = model(ids, mask)
    plain = model(ids)
    assert torch.isfinite(padded).all()  # fully padded query rows must not produce NaN
    for r, p in enumerate(pads):
        if p == 0:
            torch.testing.assert_close(padded[r], plain[r], rtol=0, atol=1e-6)
        else:
            # Real tokens of a left-padded row see exactly the unpadded sequence, positions
            # restarting at 0; so the row differs from the unmasked run of the same ids.
            torch.testing.assert_close(padded[r:r + 1, p:], model(ids[r:r + 1, p:]),
                                       rtol=1e-5, atol=1e-5)
            assert not torch.allclose(padded[r, p:], plain[r, p:], atol=1e-3)


def test_gpt2_dropout_zero_train_equals_eval():
    model, args, _ = gpt2_tiny()
    train_out = model(*args)
    torch.testing.assert_close(model.eval()(*args), train_out, rtol=0, atol=0)


def test_init_weights_deterministic_and_nontrivial():
    a, _, _ = llama_tiny(seed=3)
    b, _, _ = llama_tiny(seed=3)
    c = init_weights(llama_tiny()[0], seed=4)
    for (fqn, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), fqn
        assert not torch.equal(pa, pc), fqn
        assert pa.std() > 0.01, fqn
    assert not torch.equal(a.norm.weight, torch.ones_like(a.norm.weight))
    assert (a.norm.weight - 1).abs().max() < 0.5


@pytest.mark.parametrize("name", sorted(TINY))
def test_dims_cover_params_with_consistent_sizes(name):
    model, args, dims = TINY[name](with_labels=True)
    sizes: dict[str, int] = {}

    def bind(what, names, shape):
        names = names.split()
        assert len(names) == len(shape), (what, names, shape)
        for n, s in zip(names, shape):
            assert sizes.setdefault(n, s) == s, (what, n, sizes[n], s)

    arg_names = ["input_ids", "attention_mask", "labels"] if "llama" in name else ["input_ids", "labels"]
    for arg_name, arg in zip(arg_names, args):
        if arg is not None:
            bind(arg_name, dims[arg_name], arg.shape)
    globs = [k for k in dims if k not in arg_names]
    for fqn, p in model.named_parameters():
        hits = [g for g in globs if fnmatch.fnmatchcase(fqn, g)]
        assert len(hits) == 1, (fqn, hits)
        bind(fqn, dims[hits[0]], p.shape)
    for g in globs:
        assert any(fnmatch.fnmatchcase(f, g) for f, _ in model.named_parameters()), g


EXPORT_CASES = {
    "llama": dict(),
    "llama_mask": dict(with_mask=True),
    "llama_labels": dict(with_labels=True),
    "llama_mask_labels": dict(with_mask=True, with_labels=True),
}


@pytest.mark.parametrize("case", sorted(EXPORT_CASES))
def test_export_llama_tiny(case):
    model, args, _ = llama_tiny(**EXPORT_CASES[case])
    ep = _export(model, args)
    torch.testing.assert_close(ep.module()(*args), model(*args))
    # Every linear node names the nn.Linear it came from: plan rows and collectives rely on it.
    linear_fqns = {
        list(n.meta["nn_module_stack"].values())[-1][0]
        for n in ep.graph.nodes if n.target is torch.ops.aten.linear.default
    }
    assert linear_fqns == {f for f, m in model.named_modules() if isinstance(m, nn.Linear)}
    ops = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.scaled_dot_product_attention.default in ops
    assert (torch.ops.aten.cross_entropy_loss.default in ops) == ("labels" in case)
    assert (torch.ops.aten.cumsum.default in ops) == ("mask" in case)


@pytest.mark.parametrize("with_labels", [False, True])
def test_export_gpt2_tiny(with_labels):
    model, args, _ = gpt2_tiny(with_labels=with_labels)
    ep = _export(model, args)
    torch.testing.assert_close(ep.module()(*args), model(*args))
    ops = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.addmm.default in ops  # Conv1D stays an addmm, not a linear
    assert torch.ops.aten.split.Tensor in ops


def test_export_llama_8b_meta_without_memory():
    t0 = time.perf_counter()
    model, args, dims = llama_8b_meta(with_labels=True)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    assert all(a is None or a.is_meta for a in args)
    ep = _export(model, args)
    elapsed = time.perf_counter() - t0
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    assert peak_gb < 4, peak_gb
    assert elapsed < 60, elapsed
    (loss,) = [n for n in ep.graph.nodes if n.op == "output"][0].args[0]
    assert loss.meta["val"].shape == () and loss.meta["val"].device.type == "meta"
    assert len(ep.graph.nodes) > 2000


def test_factory_lookup():
    assert factory("llama_tiny") is llama_tiny
    assert set(FACTORIES) == {"llama_tiny", "gpt2_tiny", "llama_8b_meta", "moe_tiny"}
    with pytest.raises(ValueError, match="llama_tiny"):
        factory("nope")
