"""Distributed checkpoints (torch.distributed.checkpoint) on the simulated mesh: bit-exact resume,
loading under another plan (reshard), consolidation into a plain state dict, torn writes,
mismatches. The same on real gloo processes: tests/test_gloo_checkpoint.py."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoshard  # noqa: E402
from autoshard.ownership import assemble, local_piece  # noqa: E402
from autoshard.runtime import run_simulated  # noqa: E402
from autoshard.runtime.execution.checkpoint import CheckpointError  # noqa: E402
from examples.models import gpt2_tiny, llama_tiny  # noqa: E402
from exactness import reference_train, reference_train64, to_float64, train_steps, within_spread  # noqa: E402

LR = 1e-2
DP_TP = dict(mesh={"dp": 2, "tp": 2}, layout={"batch": "dp", "heads": "tp", "ffn": "tp"})
TP4 = dict(mesh={"tp": 4}, layout={"heads": "tp", "ffn": "tp"})
DP4 = dict(mesh={"dp": 4}, layout={"batch": "dp"})


def make_plan(config, **options):
    model, args, dims = llama_tiny(with_labels=True)
    plan = autoshard.autoshard(model, args, mesh=autoshard.Mesh(config["mesh"]), dims=dims,
                               layout=config["layout"], train=True, **options)
    return plan, args


def batches(args, n):
    """n different batches of the planned shape (ids and labels)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 64, args[0].shape, generator=gen)
        out.append((ids, None, ids.clone()))
    return out


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def straight_and_resumed(plan, path, steps=4, cut=2):
    data = batches(plan.example_inputs[0], steps)

    def rank_fn(rank):
        local = plan.build(rank)
        opt = plan.optimizer(local, torch.optim.AdamW, lr=LR, weight_decay=0.1)
        straight = train_steps(local, opt, data)
        full_straight = local.full_parameters()
        local = plan.build(rank)
        opt = plan.optimizer(local, torch.optim.AdamW, lr=LR, weight_decay=0.1)
        first = train_steps(local, opt, data[:cut])
        plan.save_checkpoint(local, opt, path, step=cut, extra={"data_position": cut})
        del local, opt
        local = plan.build(rank)  # fresh weights: everything must come from the checkpoint
        opt = plan.optimizer(local, torch.optim.AdamW, lr=LR, weight_decay=0.1)
        info = plan.load_checkpoint(local, opt, path)
        assert info["step"] == cut and info["extra"] == {"data_position": cut}
        second = train_steps(local, opt, data[info["extra"]["data_position"]:])
        return straight, full_straight, first + second, local.full_parameters()

    return run_simulated(plan.mesh, rank_fn)


@pytest.mark.parametrize("options", [dict(zero_stage=0), dict(zero_stage=3, reshard_after_forward=True),
                                     dict(zero_stage=1), dict(zero_stage=2)],
                         ids=["zero0", "zero3", "zero1", "zero2"])
def test_resume_is_bit_exact_on_the_simulated_mesh(tmp_path, options):
    plan, _ = make_plan(DP_TP, **options)
    for straight, p_straight, resumed, p_resumed in straight_and_resumed(plan, tmp_path / "ckpt"):
        assert resumed == straight  # bit for bit
        assert p_straight.keys() == p_resumed.keys()
        for fqn in p_straight:
            assert torch.equal(p_straight[fqn], p_resumed[fqn]), fqn


def _rank_state(plan, local, opt):
    """This rank's stored parameters and optimizer state by FQN, next to their slot."""
    slots = {s.name: s for s in local.spec.slots}
    named = [(n, p) for n, p in local.named_parameters() if p.requires_grad]
    inner = [q for g in opt.inner.param_groups for q in g["params"]]
    assert len(named) == len(inner)
    return {local.fqn_of[n]: (slots[n], p.detach().clone(), {k: v.clone() for k, v in opt.inner.state[q].items()})
            for (n, p), q in zip(named, inner)}


def _expected_piece(full, slot, mesh, rank, state: bool):
    """The block of ``full`` this rank keeps of a parameter (``state=False``) or of its optimizer
    state (``state=True``), from the slot's placements (independent of the checkpoint code)."""
    if state and slot.zero1 is not None:
        axis, d = slot.zero1
        whole = local_piece(full, slot.placement, mesh, rank)
        n = whole.shape[d] // mesh.axes[axis]
        return whole.narrow(d, mesh.coords(rank)[axis] * n, n)
    return local_piece(full, slot.placement, mesh, rank)


def eager_reference(data, steps, dtype=torch.float32):
    """Single-device AdamW: the global parameters and moments, made without autoshard (in
    ``dtype``: float64 gives the float32 spread bound of tests/exactness.py)."""
    model, _, _ = llama_tiny(with_labels=True)
    model = model.to(dtype)
    opt = adamw(model.parameters())
    for b in (data if dtype == torch.float32 else to_float64(data))[:steps]:
        model(*b).backward()
        opt.step()
        opt.zero_grad()
    params = dict(model.named_parameters())
    return params, {n: opt.state[p] for n, p in params.items()}


def test_reshard_dp_tp_zero3_to_tp4_dp4_zero1_and_one_device(tmp_path):
    src, args = make_plan(DP_TP, zero_stage=3, reshard_after_forward=True)
    data = batches(args, 2)
    path = tmp_path / "ckpt"

    def save_fn(rank):
        local = src.build(rank)
        opt = src.optimizer(local, torch.optim.AdamW, lr=LR, weight_decay=0.1)
        train_steps(local, opt, data)
        src.save_checkpoint(local, opt, path, step=2)
        return _rank_state(src, local, opt)

    saved = run_simulated(src.mesh, save_fn)
    # the saved global values, assembled from every rank's pieces as they were in memory
    glob = {}
    for fqn, (slot, _, st) in saved[0].items():
        glob[fqn] = {"param": assemble([r[fqn][1] for r in saved], slot.placement, src.mesh)}
        for k in ("exp_avg", "exp_avg_sq"):
            glob[fqn][k] = assemble([r[fqn][2][k] for r in saved], slot.placement, src.mesh)
        glob[fqn]["step"] = st["step"]
    # ... which equal single-device training (independent of autoshard)
    ref_params, ref_state = eager_reference(data, 2)
    params64, state64 = eager_reference(data, 2, torch.float64)
    # Adam divides by sqrt(v): where a gradient is ~0, summation-order differences move the
    # update by a fraction of lr. Parameters and moments within the float32 spread of
    # single-device training itself (float32 against float64, per tensor: tests/exactness.py).
    for fqn, g in glob.items():
        within_spread(g["param"], ref_params[fqn], params64[fqn], fqn)
        for k in ("exp_avg", "exp_avg_sq"):
            within_spread(g[k], ref_state[fqn][k], state64[fqn][k], f"{fqn} {k}")

    for config, options in [(TP4, {}), (DP4, dict(zero_stage=1))]:
        dst, _ = make_plan(config, **options)

        def load_fn(rank):
            local = dst.build(rank)
            opt = dst.optimizer(local, torch.optim.AdamW, lr=LR, weight_decay=0.1)
            assert dst.load_checkpoint(local, opt, path)["step"] == 2
            return _rank_state(dst, local, opt)

        for rank, got in enumerate(run_simulated(dst.mesh, load_fn)):
            assert got.keys() == glob.keys()
            for fqn, (slot, param, st) in got.items():
                want = glob[fqn]
                assert torch.equal(param, _expected_piece(want["param"], slot, dst.mesh, rank, False)), fqn
                for k in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(st[k], _expected_piece(want[k], slot, dst.mesh, rank, True)), (fqn, k)
                assert torch.equal(st["step"], want["step"])

    # one device: the plain model and a plain torch optimizer
    from autoshard.runtime.execution.checkpoint import load_into_module

    model, _, _ = llama_tiny(with_labels=True, seed=5)  # other weights: all must be overwritten
    opt = adamw(model.parameters())
    assert load_into_module(model, opt, path)["step"] == 2
    for fqn, p in model.named_parameters():
        assert torch.equal(p.detach(), glob[fqn]["param"]), fqn
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][k], glob[fqn][k]), (fqn, k)


def test_resume_on_another_plan_continues_like_one_device(tmp_path):
    """Saved under dp=2 x tp=2 ZeRO-3, two more steps under tp=4 equal four steps on one device."""
    src, args = make_plan(DP_TP, zero_stage=3, reshard_after_forward=True)
    data = batches(args, 4)
    path = tmp_path / "ckpt"

    def save_fn(rank):
        local = src.build(rank)
        opt = src.optimizer(local, torch.optim.AdamW, lr=LR, weight_decay=0.1)
        train_steps(local, opt, data[:2])
        src.save_checkpoint(local, opt, path, step=2)

    run_simulated(src.mesh, save_fn)
    dst, _ = make_plan(TP4)

    def resume_fn(rank):
        local = dst.build(rank)
        opt = dst.optimizer(local, torch.optim.AdamW, lr=LR, weight_decay=0.1)
        dst.load_checkpoint(local, opt, path)
        return train_steps(local, opt, data[2:]), local.full_parameters()

    results = run_simulated(dst.mesh, resume_fn)
    model, _, _ = llama_tiny(with_labels=True)
    # the unsharded model, the same steps, in float32 and float64: the float32 spread bound
    # (tests/exactness.py; Adam: see the test above)
    losses32, params32 = reference_train(model, data, adamw)
    losses64, params64 = reference_train64(model, data, adamw)
    within_spread(torch.tensor(results[0][0]), torch.tensor(losses32[2:]), torch.tensor(losses64[2:]), "losses")
    for fqn, p in params32.items():
        got = assemble([r[1][fqn] for r in results], dst.placement_of(fqn), dst.mesh)
        within_spread(got, p, params64[fqn], fqn)


def test_consolidate_loads_strictly_into_the_model_class_with_tied_weights(tmp_path):
    model, args, dims = gpt2_tiny(with_labels=True)
    plan = autoshard.autoshard(model, args, mesh=autoshard.Mesh({"dp": 2, "tp": 2}), dims=dims,
                               layout={"batch": "dp", "heads": "tp", "ffn": "tp"}, train=True, zero_stage=3)
    assert plan.captured.aliases  # lm_head.weight is tied to wte.weight

    def fn(rank):
        local = plan.build(rank)
        opt = plan.optimizer(local, torch.optim.SGD, lr=0.1, momentum=0.9)
        loss = local(*args)
        loss.backward()
        opt.step()
        plan.save_checkpoint(local, opt, tmp_path / "ckpt", step=1)

    run_simulated(plan.mesh, fn)
    state = autoshard.consolidate(tmp_path / "ckpt")
    fresh, _, _ = gpt2_tiny(with_labels=True, seed=3)
    fresh.load_state_dict(state, strict=True)  # raises on any missing or unexpected key
    assert list(state) == list(model.state_dict())
    # one SGD step on one device gives the same weights (SGD: linear in the gradient, so the
    # exact-zero gradient of the key bias stays ~0 instead of Adam's +-lr)
    ref = gpt2_tiny(with_labels=True)[0]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref(*args).backward()
    opt.step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def test_torn_write_never_loads(tmp_path, monkeypatch):
    plan, _ = make_plan(DP_TP, zero_stage=3)
    path = tmp_path / "ckpt"
    import torch.distributed.checkpoint.filesystem as fs

    real = fs._write_files_from_queue

    def dies_after_writing(*a, **k):
        real(*a, **k)  # this rank's files are on disk ...
        from autoshard.runtime import current
        if current().rank == 1:
            raise KeyboardInterrupt("killed")  # ... and then it dies before the save completes

    def save_fn(rank):
        local = plan.build(rank)
        opt = plan.optimizer(local, torch.optim.AdamW, lr=LR)
        plan.save_checkpoint(local, opt, path, step=0)

    monkeypatch.setattr(fs, "_write_files_from_queue", dies_after_writing)
    with pytest.raises(BaseException, match="killed"):
        run_simulated(plan.mesh, save_fn)
    assert not path.exists()
    partial = tmp_path / ".ckpt.partial"
    assert any(f.suffix == ".distcp" for f in partial.iterdir())  # files were written

    def load_fn(rank):
        local = plan.build(rank)
        return plan.load_checkpoint(local, plan.optimizer(local, torch.optim.AdamW, lr=LR), path)

    with pytest.raises(CheckpointError, match="checkpoint .*ckpt is incomplete: its save was interrupted"):
        run_simulated(plan.mesh, load_fn)
    with pytest.raises(CheckpointError, match="incomplete"):
        run_simulated(plan.mesh, lambda r: plan.load_checkpoint(plan.build(r), None, partial))
    with pytest.raises(CheckpointError, match="incomplete"):
        autoshard.consolidate(path)

    monkeypatch.setattr(fs, "_write_files_from_queue", real)
    run_simulated(plan.mesh, save_fn)  # a later complete save replaces the debris
    assert not partial.exists() and run_simulated(plan.mesh, load_fn)[0]["step"] == 0
    # a torn save over a complete checkpoint leaves the old one intact and loadable
    monkeypatch.setattr(fs, "_write_files_from_queue", dies_after_writing)
    with pytest.raises(BaseException, match="killed"):
        run_simulated(plan.mesh, save_fn)
    assert run_simulated(plan.mesh, load_fn)[0]["step"] == 0
    # a file cut short after the save (disk trouble) is caught before reading
    data = next(f for f in path.iterdir() if f.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"incomplete: {data.name} is 100 bytes"):
        run_simulated(plan.mesh, load_fn)


def test_mismatched_checkpoint_names_the_first_difference(tmp_path):
    plan, _ = make_plan(DP_TP)

    def save_fn(rank):
        local = plan.build(rank)
        plan.save_checkpoint(local, plan.optimizer(local, torch.optim.AdamW, lr=LR), tmp_path / "ckpt")

    run_simulated(plan.mesh, save_fn)
    model, args, dims = llama_tiny(with_labels=True, intermediate_size=128)
    other = autoshard.autoshard(model, args, mesh=autoshard.Mesh({"tp": 2}), dims=dims,
                                layout={"heads": "tp", "ffn": "tp"}, train=True)
    with pytest.raises(CheckpointError, match=r"ckpt: model\.layers\.0\.mlp\.\w+_proj\.weight has shape "
                                              r"\[\d+, \d+\], this plan has \[\d+, \d+\]"):
        run_simulated(other.mesh, lambda r: other.load_checkpoint(other.build(r), None, tmp_path / "ckpt"))
    model, args, dims = llama_tiny(with_labels=True, num_layers=3)
    deeper = autoshard.autoshard(model, args, mesh=autoshard.Mesh({"tp": 2}), dims=dims,
                                 layout={"heads": "tp", "ffn": "tp"}, train=True)
    with pytest.raises(CheckpointError, match=r"has no 'model\.layers\.2\..*'"):
        run_simulated(deeper.mesh, lambda r: deeper.load_checkpoint(deeper.build(r), None, tmp_path / "ckpt"))


@pytest.mark.parametrize("kind", ["bf16-zero3", "experts-ep"])
def test_resume_is_bit_exact_with_mixed_precision_and_experts(tmp_path, kind):
    """fp32 master copies (saved as optim.<FQN>.fp32_master) and experts owned by one ep index
    (written by their owners only) resume bit for bit, and consolidate into the model class."""
    from examples.models import moe_tiny

    if kind == "bf16-zero3":
        model, args, dims = llama_tiny(with_labels=True)
        plan = autoshard.autoshard(model, args, mesh=autoshard.Mesh(DP_TP["mesh"]), dims=dims,
                                   layout=DP_TP["layout"], train=True, zero_stage=3,
                                   precision={"param": torch.bfloat16, "reduce": torch.float32})
    else:
        model, args, dims = moe_tiny(experts="looped", with_labels=True)
        plan = autoshard.autoshard(model, args, mesh=autoshard.Mesh({"dp": 2, "ep": 2}), dims=dims,
                                   layout={"batch": ("dp", "ep"), "experts": "ep"}, train=True)
    for straight, p_straight, resumed, p_resumed in straight_and_resumed(plan, tmp_path / "ckpt"):
        assert resumed == straight
        for fqn in p_straight:
            assert torch.equal(p_straight[fqn], p_resumed[fqn]), fqn
    state = autoshard.consolidate(tmp_path / "ckpt")
    fresh = (llama_tiny(with_labels=True, seed=9) if kind == "bf16-zero3"
             else moe_tiny(experts="looped", with_labels=True, seed=9))[0]
    fresh.load_state_dict(state, strict=True)
    if kind == "bf16-zero3":
        masters = autoshard.runtime.execution.checkpoint.consolidate_optimizer(tmp_path / "ckpt")
        w = "layers.0.mlp.up_proj.weight" if "layers.0.mlp.up_proj.weight" in masters else next(iter(masters))
        assert masters[w]["fp32_master"].dtype == torch.float32
        assert torch.equal(masters[w]["fp32_master"].to(torch.bfloat16), state[w])


def test_the_manifest_lists_what_dcp_wrote_not_what_the_directory_holds(tmp_path, monkeypatch):
    """Data files removed while the save runs (another job cleaning the directory) fail the save:
    the manifest comes from DCP's write results, so it can never mark an empty checkpoint
    complete; a manifest that lists no data files is refused on load."""
    import json
    import torch.distributed.checkpoint.filesystem as fs

    plan, _ = make_plan(DP_TP)
    path = tmp_path / "ckpt"
    real = fs._write_files_from_queue

    def written_then_removed(*a, **k):
        out = real(*a, **k)
        for f in (tmp_path / ".ckpt.partial").glob("*.distcp"):
            f.unlink(missing_ok=True)  # (every rank's thread cleans up: one may have removed it already)
        return out

    def save_fn(rank):
        local = plan.build(rank)
        plan.save_checkpoint(local, plan.optimizer(local, torch.optim.AdamW, lr=LR), path, step=0)

    monkeypatch.setattr(fs, "_write_files_from_queue", written_then_removed)
    with pytest.raises(CheckpointError, match=r"\.distcp is missing bytes after the save; DCP wrote \d+"):
        run_simulated(plan.mesh, save_fn)
    assert not path.exists()
    monkeypatch.setattr(fs, "_write_files_from_queue", real)
    run_simulated(plan.mesh, save_fn)
    manifest = json.loads((path / "autoshard.json").read_text())
    assert sorted(manifest["files"]) == sorted(f.name for f in path.iterdir() if f.name != "autoshard.json")
    assert sum(n.endswith(".distcp") for n in manifest["files"]) >= 1 and ".metadata" in manifest["files"]
    manifest["files"] = {".metadata": manifest["files"][".metadata"]}
    (path / "autoshard.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="lists no data files"):
        autoshard.consolidate(path)
