"""A catalog of bad inputs and faults, as a hostile user would try them.

Every case asserts one of two things:

- **refused**: one line (no traceback, no graph dump) of a documented exception type
  (docs/exact-or-refused.md) whose text names the cause (the argument, dim, key, input or source line);
- **exact**: the plan's result equals the unsharded model's.

Cases are small and in-process (the API, the command line, an exported run.py before its
process group starts); the multi-process faults (a stalled or killed rank, shutdown) are the slow
tests at the end.
"""
from __future__ import annotations

import functools
import math
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]

import autoshard
from autoshard import LayoutError, Mesh, cli
from autoshard.passes.capture import CaptureError

MODELS = str(ROOT / "examples" / "models.py")
LLAMA = f"{MODELS}:llama_tiny"


# ------------------------------------------------------------------------------------------------
# small models
# ------------------------------------------------------------------------------------------------

MLP_DIMS = {"input": "batch hidden", "0.weight": "ffn hidden", "2.weight": "hidden ffn"}


def mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 8, bias=False))
    return model, (torch.randn(4, 8),)


@functools.lru_cache(maxsize=None)
def mlp_captured():
    """One capture of the MLP shared by the cases that fail after capture (fast)."""
    model, args = mlp()
    plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2}), dims=MLP_DIMS, layout={"batch": "dp"})
    return model, args, plan.captured


def plan_mlp(**options):
    model, args, cap = mlp_captured()
    options = {"mesh": Mesh({"dp": 2}), "dims": MLP_DIMS, "layout": {"batch": "dp"}, "captured": cap, **options}
    return autoshard.autoshard(model, args, **options)


class Branchy(nn.Module):
    """A Python branch on a tensor's value: torch.export cannot capture it."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        y = self.proj(x)
        if y.sum() > 0:
            return y * 2
        return y


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Branchy()

    def forward(self, x):
        return self.inner(x) + 1


class Triple(torch.autograd.Function):
    """A custom autograd Function whose backward is not the derivative of its forward."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 3


class WithFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return Triple.apply(self.proj(x)).sum()


class WithParameterWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.scale = nn.Linear(4, 4), nn.Parameter(torch.ones(4), requires_grad=False)

    def forward(self, x):
        self.scale.mul_(2)
        return self.proj(x) * self.scale


def _plan_small(model):
    return autoshard.autoshard(model, (torch.randn(2, 4),), mesh=Mesh({"dp": 2}), dims=["batch -"],
                               layout={"batch": "dp"})


# ------------------------------------------------------------------------------------------------
# refused: (name, exception type, pattern the one-line message must contain, the call)
# ------------------------------------------------------------------------------------------------

REFUSED = {
    # layout and dims of the wrong type
    "layout_value_int": (TypeError, r"layout\['batch'\] is 2 \(int\)",
                         lambda: plan_mlp(layout={"batch": 2})),
    "layout_value_mixed_list": (TypeError, r"layout\['batch'\] is \['dp', 2\]",
                                lambda: plan_mlp(layout={"batch": ["dp", 2]})),
    "layout_as_string": (TypeError, r"layout is 'batch=dp' \(str\)",
                         lambda: plan_mlp(layout="batch=dp")),
    "layout_key_int": (TypeError, r"layout key 0 \(int\) is not a dim name",
                       lambda: plan_mlp(layout={0: "dp"})),
    "dims_int": (TypeError, r"dims is 5 \(int\)", lambda: plan_mlp(dims=5)),
    "dims_value_int": (TypeError, r"dims\['input'\] is 3 \(int\)", lambda: plan_mlp(dims={"input": 3})),
    "dims_list_entry_int": (TypeError, r"dims\[0\] is 7 \(int\)", lambda: plan_mlp(dims=[7])),
    # meshes
    "mesh_bool_size": (ValueError, r"mesh axis 'dp' has size True", lambda: Mesh({"dp": True})),
    "mesh_zero_size": (ValueError, r"mesh axis 'dp' has size 0", lambda: Mesh({"dp": 0})),
    "mesh_float_size": (ValueError, r"mesh axis 'tp' has size 2.0", lambda: Mesh({"tp": 2.0})),
    "mesh_bad_name": (ValueError, r"mesh axis name 'd p' must be an identifier", lambda: Mesh({"d p": 2})),
    "mesh_empty": (ValueError, r"a mesh needs at least one axis", lambda: Mesh({})),
    "mesh_as_string": (TypeError, r"got str 'dp=2,tp=2' \(write Mesh\(\{'dp': 2, 'tp': 2\}\)\)",
                       lambda: plan_mlp(mesh="dp=2,tp=2")),
    "mesh_as_pairs": (TypeError, r"got list \[\('dp', 2\)\] \(write Mesh\(\{'dp': 2\}\)\)",
                      lambda: plan_mlp(mesh=[("dp", 2)])),
    "mesh_auto_zero": (ValueError, r"Mesh.auto needs a positive device count, got 0", lambda: Mesh.auto(0)),
    # training options
    "zero_stage_true": (ValueError, r"zero_stage must be 0, 1, 2 or 3 \(or None\), not True \(bool\)",
                        lambda: plan_mlp(train=True, zero_stage=True)),
    "zero_stage_4": (ValueError, r"not 4 \(int\)", lambda: plan_mlp(train=True, zero_stage=4)),
    "zero_stage_without_train": (ValueError, r"zero_stage .* pass train=True", lambda: plan_mlp(zero_stage=2)),
    "reshard_without_zero3": (ValueError, r"reshard_after_forward applies to zero_stage=3",
                              lambda: plan_mlp(train=True, zero_stage=1, reshard_after_forward=True)),
    "memory_limit_word": (ValueError, r"memory_limit 'lots'", lambda: plan_mlp(memory_limit="lots")),
    "memory_limit_negative": (ValueError, r"memory_limit must be positive, got -1", lambda: plan_mlp(memory_limit=-1)),
    "memory_limit_impossible": (ValueError, r"no plan fits memory_limit=100 bytes",
                                lambda: plan_mlp(layout=None, memory_limit=100)),
    "search_false_with_limit": (ValueError, r"memory_limit need the search",
                                lambda: plan_mlp(memory_limit="1GB", search=False)),
    "hardware_misspelt": (ValueError, r"'h1000' is neither a hardware preset", lambda: plan_mlp(hardware="h1000")),
    "precision_not_dtype": (ValueError, r"precision\['param'\] must be a floating torch dtype",
                            lambda: plan_mlp(precision={"param": "bf16"})),
    "moe_unknown_key": (ValueError, r"moe= takes 'capacity_factor', not \['top_k'\]",
                        lambda: plan_mlp(moe={"top_k": 2})),
    # names and layouts the model does not have
    "layout_unknown_dim": (LayoutError, r"layout names dim 'batsh', which no tensor has",
                           lambda: plan_mlp(layout={"batsh": "dp"})),
    "layout_unknown_axis": (LayoutError, r"layout\['batch'\] names mesh axis 'tp'",
                            lambda: plan_mlp(layout={"batch": "tp"})),
    "layout_repeated_axis": (LayoutError, r"layout\['batch'\] repeats a mesh axis",
                             lambda: plan_mlp(layout={"batch": ("dp", "dp")})),
    "layout_indivisible": (LayoutError, r"dim 'batch' has size 4, which mesh axes \('dp',\) .* cannot split evenly",
                           lambda: plan_mlp(mesh=Mesh({"dp": 3}))),
    "dims_wrong_count": (LayoutError, r"dims\['input'\] gives 1 names \('batch'\) for input",
                         lambda: plan_mlp(dims={"input": "batch"})),
    "dims_unknown_key": (LayoutError, r"dims names 'inptu', which matches no argument",
                         lambda: plan_mlp(dims={"inptu": "batch hidden"})),
    # capture (item 11): one short line naming the source line and the module, no graph dump
    "data_dependent_branch": (CaptureError, r"could not capture Branchy: data-dependent control flow .*"
                                            r"test_bad_inputs.py:\d+ in forward \(module <root>\): `if y.sum\(\) > 0:`",
                              lambda: autoshard.autoshard(Branchy(), (torch.randn(2, 4),), mesh=Mesh({"dp": 2}),
                                                          dims=["batch -"], layout={"batch": "dp"})),
    "data_dependent_branch_submodule": (CaptureError, r"could not capture Outer: .*\(module inner\)",
                                        lambda: autoshard.autoshard(Outer(), (torch.randn(2, 4),),
                                                                    mesh=Mesh({"dp": 2}), dims=["batch -"],
                                                                    layout={"batch": "dp"})),
    # model features and inputs a plan would not reproduce (items 2-4, refused by passes/guards.py
    # and runtime/execution/inputs.py)
    "simulate_other_batch": (autoshard.InputMismatchError, r"input input has shape \(8, 8\); the plan was made "
                                                           r"for shape \(4, 8\)",
                             lambda: plan_mlp().simulate(torch.randn(8, 8))),
    "custom_autograd_function": (autoshard.UnsupportedModelError, r"custom autograd Function Triple \(at "
                                                                  r"test_bad_inputs.py:\d+\)",
                                 lambda: _plan_small(WithFunction())),
    "parameter_written_in_place": (autoshard.UnsupportedModelError, r"updates the parameter scale in place "
                                                                    r"\(mul_.Tensor in module <root>",
                                   lambda: _plan_small(WithParameterWrite())),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_in_one_line(name, capfd):
    exc, pattern, call = REFUSED[name]
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    assert "\n" not in msg.strip(), f"{name}: not one line:\n{msg}"
    assert re.search(pattern, msg), f"{name}: {msg!r} does not match {pattern!r}"
    assert len(msg) < 600, f"{name}: {len(msg)} characters"
    out, err = capfd.readouterr()
    assert "def forward" not in out + err, "a graph was dumped"  # torch.export's partial graph


def test_capture_still_replays_warnings_when_it_succeeds(capfd):
    # the held-back output of a successful export is not lost
    model, args = mlp()
    plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2}), dims=MLP_DIMS, layout={"batch": "dp"})
    torch.testing.assert_close(plan.simulate(*args), model(*args), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# exact: what is accepted gives the unsharded model's result
# ------------------------------------------------------------------------------------------------

class _Total(nn.Module):
    def forward(self, x):
        return x.sum()


def _mlp_exact(**options):
    model, args = mlp()
    if options.get("train"):
        model.append(_Total())  # training needs a scalar loss, as loss.backward() does
    plan = autoshard.autoshard(model, args, dims=MLP_DIMS, **options)
    want = model(*args)
    torch.testing.assert_close(plan.simulate(*args), want, rtol=1e-5, atol=1e-6)
    loss, grads = plan.simulate_grads(*args)
    want.sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6)


EXACT = {
    "layout_list_of_axes": dict(mesh=Mesh({"dp": 2, "tp": 2}), layout={"batch": ["dp"], "ffn": ["tp"]}),
    "layout_two_axes_one_dim": dict(mesh=Mesh({"dp": 2, "tp": 2}), layout={"ffn": ("tp", "dp")}),
    "layout_none_entries_only": dict(mesh=Mesh({"tp": 2}), layout={"batch": None}),
    "mesh_as_plain_dict": dict(mesh={"tp": 2}, layout={"ffn": "tp"}),
    "zero_stage_int_zero": dict(mesh=Mesh({"dp": 2}), layout={"batch": "dp"}, train=True, zero_stage=0),
}


@pytest.mark.parametrize("name", sorted(EXACT))
def test_accepted_is_exact(name):
    _mlp_exact(**EXACT[name])


# ------------------------------------------------------------------------------------------------
# the command line (item 10): library errors in one line, exit code 2; `run ... -- ARGS`
# ------------------------------------------------------------------------------------------------

class _Boom:
    pass


CLI = {
    "zero_stage_without_train": (["plan", LLAMA, "--mesh", "dp=2", "--layout", "batch=dp", "--zero-stage", "2"],
                                 {}, r"--zero-stage 2 shards training state.*\(hint: add --train\)"),
    "impossible_memory_limit": (["plan", LLAMA, "--mesh", "dp=2", "--memory-limit", "1KB"], {},
                                r"no plan fits memory_limit=1000 bytes per rank"),
    "misspelt_hardware_env": (["plan", LLAMA, "--mesh", "dp=2", "--layout", "batch=dp"],
                              {"AUTOSHARD_HARDWARE": "h1000"}, r"'h1000' is neither a hardware preset"),
    "calibrate_process_count": (["calibrate", "dp=2", "3"], {}, r"mesh \{'dp': 2\} has 2 ranks but nprocs=3"),
    "factory_raises": (["plan", "{factory}:broken", "--mesh", "dp=2"], {},
                       r"calling .*:broken failed: ZeroDivisionError: division by zero at .*factory.py:3"),
    "data_dependent_model": (["plan", "{factory}:branchy", "--mesh", "dp=2", "--layout", "batch=dp"], {},
                             r"could not capture Branchy: data-dependent control flow .*`if y.sum\(\) > 0:`"),
}

FACTORY = '''import torch
def broken():
    return 1 / 0
class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
    def forward(self, x):
        y = self.proj(x)
        if y.sum() > 0:
            return y * 2
        return y
def branchy():
    return Branchy(), (torch.randn(2, 4),), ["batch -"]
'''


@pytest.mark.parametrize("name", sorted(CLI))
def test_cli_library_errors_are_one_line(name, capsys, monkeypatch, tmp_path):
    argv, env, pattern = CLI[name]
    (tmp_path / "factory.py").write_text(FACTORY)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AUTOSHARD_DEBUG", raising=False)
    rc = cli.main([a.replace("{factory}", str(tmp_path / "factory.py")) for a in argv])
    out, err = capsys.readouterr()
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("autoshard: error: "), err
    assert "Traceback" not in err and "def forward" not in err
    assert re.search(pattern, err), err


def test_cli_debug_shows_the_traceback(monkeypatch):
    monkeypatch.setenv("AUTOSHARD_DEBUG", "1")
    with pytest.raises(ValueError, match="nprocs=3"):
        cli.main(["calibrate", "dp=2", "3"])


def test_cli_run_passes_arguments_after_the_double_dash(monkeypatch, capsys):
    """`autoshard run TARGET --mesh ... -- RUN.PY ARGS`, options after TARGET (README's form)."""
    seen = {}
    monkeypatch.setattr(cli, "_launch", lambda cmd, timeout: seen.setdefault("cmd", cmd) and 0)
    rc = cli.main(["run", LLAMA, "--mesh", "tp=2", "--layout", "heads=tp,ffn=tp", "--steps", "1",
                   "--no-check", "--", "--timeout", "30", "--seed", "3"])
    assert rc == 0, capsys.readouterr().err
    cmd = seen["cmd"]
    assert cmd[-5:] == ["--steps", "1", "--timeout", "30", "--seed", "3"][-5:] and "--timeout" in cmd, cmd
    assert cmd[cmd.index("--steps"):] == ["--steps", "1", "--timeout", "30", "--seed", "3"]
    with pytest.raises(SystemExit):
        cli.main(["plan", LLAMA, "--mesh", "tp=2", "--", "--seed", "3"])  # only `run` takes them


# ------------------------------------------------------------------------------------------------
# an exported run.py, before its process group starts (items 6 and 9): RunError, one line
# ------------------------------------------------------------------------------------------------

from autoshard.runtime import export as R
from autoshard.passes.export import simulate_export


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    """The dp=2 x tp=2 Llama export (its attention_mask input is None) and the model's state dict."""
    from examples.models import llama_tiny

    model, args, dims = llama_tiny(with_labels=True)
    plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2, "tp": 2}), dims=dims,
                               layout={"batch": "dp", "heads": "tp", "ffn": "tp"})
    base = tmp_path_factory.mktemp("runpy")
    path = plan.export(base / "llama", args)
    return path, {k: v.detach().clone() for k, v in model.state_dict().items()}, args


def _edit_json(d, fn):
    import json

    doc = json.loads((d / "plan.json").read_text())
    fn(doc)
    (d / "plan.json").write_text(json.dumps(doc))


def _user(doc, target):
    return next(m for m in doc["inputs"] if m["target"] == target)


def _save_inputs(d, fn):
    ids, mask, labels = torch.load(d / "inputs.pt", weights_only=True)["inputs"]
    torch.save({"inputs": fn([ids, mask, labels])}, d / "bad_inputs.pt")
    return ["--inputs", str(d / "bad_inputs.pt")]


def _save_ckpt(d, state, fn):
    torch.save(fn(dict(state)), d / "ckpt.pt")
    return ["--weights", str(d / "ckpt.pt")]


def _weights_file(d, fn):
    state = torch.load(d / "weights.pt", weights_only=True)
    torch.save(fn(state), d / "weights.pt")
    return []


RUNPY = {
    # item 6: checkpoints whose keys do not match
    "ckpt_prefixed_keys": (lambda d, s: _save_ckpt(d, s, lambda st: {"model." + k: v for k, v in st.items()}),
                           r"missing \d+ parameter\(s\) \(embed_tokens.weight, .*unexpected key\(s\) \(model\..*"
                           r"prefix 'model\.': strip it"),
    "ckpt_partial": (lambda d, s: _save_ckpt(d, s, lambda st: {k: v for k, v in st.items() if "layers.1." not in k}),
                     r"missing \d+ parameter\(s\) \(layers\.1\..*--allow-partial takes the missing ones"),
    "ckpt_other_model": (lambda d, s: _save_ckpt(d, s, lambda st: {"fc.weight": torch.zeros(3)}),
                         r"missing \d+ parameter\(s\).*unexpected key\(s\) \(fc.weight\)"),
    "allow_partial_without_weights": (lambda d, s: ["--allow-partial"], r"--allow-partial applies to a --weights"),
    # item 9: dtypes of weights, checkpoints and inputs
    "ckpt_int_weights": (lambda d, s: _save_ckpt(d, s, lambda st: {k: v.long() for k, v in st.items()}),
                         r"weights of the wrong dtype: \S+ is int64, the plan has float32"),
    "weights_file_int8": (lambda d, s: _weights_file(d, lambda st: {k: v.to(torch.int8) for k, v in st.items()}),
                          r"weights of the wrong dtype: \S+ is int8, the plan has float32"),
    "float_token_ids": (lambda d, s: _save_inputs(d, lambda x: [x[0].float(), x[1], x[2]]),
                        r"input input_ids has dtype float32; the program was planned for int64 \(token ids"),
    "int32_labels": (lambda d, s: _save_inputs(d, lambda x: [x[0], x[1], x[2].int()]),
                     r"input labels has dtype int32; the program was planned for int64"),
    "tensor_where_plan_had_none": (lambda d, s: _save_inputs(d, lambda x: [x[0], torch.ones(4, 8), x[2]]),
                                   r"input attention_mask is a tensor \[4, 8\], but the program was planned with "
                                   r"None there"),
    "input_missing": (lambda d, s: _save_inputs(d, lambda x: x[:2]), r"must hold a list of 3 inputs"),
    "input_wrong_shape": (lambda d, s: _save_inputs(d, lambda x: [x[0][:2], x[1], x[2]]),
                          r"input input_ids is \[2, 8\]; the program was planned for shape \[4, 8\]"),
    # item 9: plan.json that would crash the ranks
    "empty_outputs": (lambda d, s: _edit_json(d, lambda doc: doc.update(outputs=[])) or [],
                      r"'outputs' is empty"),
    "placement_dim_out_of_range": (lambda d, s: _edit_json(d, lambda doc: _user(doc, "input_ids").update(
        placement=["S(5)", "R"])) or [], r"input 'input_ids' is sharded on dim 5, but it has 2 dims"),
    "weight_placement_dim_out_of_range": (lambda d, s: _edit_json(d, lambda doc: _user(doc, "norm.weight").update(
        placement=["R", "S(1)"])) or [], r"input 'norm.weight' is sharded on dim 1, but it has 1 dim\b"),
    "output_placement_dim_out_of_range": (lambda d, s: _edit_json(d, lambda doc: doc["outputs"][0].update(
        placement=["S(0)", "R"])) or [], r"output 0 is sharded on dim 0, but it has 0 dims"),
    "bad_dtype_name": (lambda d, s: _edit_json(d, lambda doc: _user(doc, "input_ids").update(dtype="Tensor")) or [],
                       r"input 'input_ids' has dtype 'Tensor'"),
    # a --ckpt directory that cannot take a checkpoint is refused before any step
    "ckpt_dir_not_writable": (lambda d, s: (d / "a-file").write_text("") or
                              ["--steps", "1", "--ckpt", str(d / "a-file" / "ck")],
                              r"^--ckpt \S+/a-file/ck is not writable: "),
}


@pytest.mark.parametrize("name", sorted(RUNPY))
def test_runpy_refuses_before_the_process_group(name, export_dir, tmp_path, monkeypatch):
    src, state, _ = export_dir
    d = tmp_path / "exp"
    shutil.copytree(src, d)
    make, pattern = RUNPY[name]
    argv = make(d, state)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(R.RunError) as info:
        R.prepare(d, R._parser().parse_args(argv))
    msg = str(info.value)
    assert "\n" not in msg and re.search(pattern, msg), f"{name}: {msg!r}"


def test_runpy_refuses_a_ckpt_directory_without_room_for_one_checkpoint(export_dir, tmp_path, monkeypatch):
    """Free space is checked against one checkpoint's size (parameters, buffers and the AdamW
    state of every trainable parameter), before the process group starts."""
    src, state, _ = export_dir
    doc = R.read_plan(src)
    params = sum(v.numel() * v.element_size() for v in state.values())  # all trainable fp32 (tied: once)
    buffers = sum(4 * math.prod(m["shape"]) for m in doc["inputs"] if m["kind"] == "buffer")  # fp32 rope table
    need = R.checkpoint_bytes(doc, "adamw")
    assert need == 3 * params + buffers  # weights and AdamW's two moments
    assert R.checkpoint_bytes(doc, "sgd") == params + buffers
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(R.training.shutil, "disk_usage", lambda p: usage._replace(free=need - 1))
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(R.RunError, match=r"^--ckpt \S+ has [\d.,]+ MiB free; one checkpoint of this program takes "):
        R.prepare(src, R._parser().parse_args(["--steps", "1", "--ckpt", str(tmp_path / "ck")]))
    monkeypatch.setattr(R.training.shutil, "disk_usage", lambda p: usage._replace(free=need))
    ctx = R.prepare(src, R._parser().parse_args(["--steps", "1", "--ckpt", str(tmp_path / "ck")]))
    ctx["loop"]["lock"].release()  # this process is the job's rank 0: it held the directory
    assert [p.name for p in (tmp_path / "ck").iterdir()] == [".autoshard-lock"]  # the write test leaves nothing


def _tokens_with(tmp_path, bad_at: int, value: int, n: int = 4 * 8 * 3):
    tokens = torch.randint(0, 50, (n,), generator=torch.Generator().manual_seed(0)).to(torch.uint16)
    tokens[bad_at] = value
    path = tmp_path / "tokens.bin"
    tokens.numpy().tofile(path)
    return path


def test_a_token_outside_the_vocabulary_names_file_position_and_vocabulary(export_dir, tmp_path):
    """Every rank checks each global batch against the embedding's rows, so all stop at the same
    step with one line (not one rank's IndexError)."""
    from autoshard.passes.export import simulate_run

    src, state, _ = export_dir
    vocab = state["embed_tokens.weight"].shape[0]
    assert _user(R.read_plan(src), "input_ids")["vocab"] == vocab
    path = _tokens_with(tmp_path, 4 * 8 + 5, vocab)  # in the second batch
    with pytest.raises(R.RunError, match=rf"--data \S+tokens.bin: token {vocab} at position 37 is outside the "
                                         rf"vocabulary of {vocab} ids \(the embedding that input_ids indexes\)"):
        simulate_run(src, "--steps", "3", "--data", str(path))
    ok = _tokens_with(tmp_path, 4 * 8 + 5, vocab - 1)
    assert len(simulate_run(src, "--steps", "3", "--data", str(ok))[0]["losses"]) == 3


def test_runpy_checkpoint_with_every_key_is_exact(export_dir, tmp_path):
    """A full checkpoint (here: the model's own weights, keys in another order) gives the
    unsharded model's outputs and gradients."""
    src, state, _ = export_dir
    torch.save(dict(reversed(list(state.items()))), tmp_path / "ckpt.pt")
    for r in simulate_export(src, steps=1, check=True, weights=tmp_path / "ckpt.pt"):
        assert r["ok"], r["problems"]


def test_runpy_allow_partial_takes_the_rest_from_the_export(export_dir, tmp_path):
    """--allow-partial: a checkpoint of some layers; the others come from the export, so with the
    model's own values for those layers the result is still the unsharded model's."""
    src, state, _ = export_dir
    torch.save({k: v for k, v in state.items() if "layers.1." not in k}, tmp_path / "part.pt")
    with pytest.raises(R.RunError, match="missing"):
        simulate_export(src, weights=tmp_path / "part.pt")
    weights = R.open_weights(src, R.read_plan(src), tmp_path / "part.pt", allow_partial=True)
    assert re.fullmatch(r"--allow-partial: \d+ of the program's parameters are not in .* come from the export .*",
                        weights.partial_note)
    for r in simulate_export(src, steps=1, check=True, weights=tmp_path / "part.pt", allow_partial=True):
        assert r["ok"], r["problems"]


# ------------------------------------------------------------------------------------------------
# multi-process faults (items 7 and 8): a stalled or killed rank, shutdown
# ------------------------------------------------------------------------------------------------

def _torchrun(path, nproc, *run_args):
    from autoshard.passes.export import torchrun_command

    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(torchrun_command(path, nproc, *run_args), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _rank_pid(launcher_pid: int, rank: int) -> int:
    """pid of the torchrun worker with RANK=rank (a child of the launcher)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if f"PPid:\t{launcher_pid}\n" not in (d / "status").read_text():
                continue
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return int(d.name)
    raise AssertionError(f"no worker with RANK={rank} under pid {launcher_pid}")


def _fault(path, sig, victim: int):
    """Train for long with --timeout 15, send ``sig`` to rank ``victim`` after its second step;
    (exit code, seconds from the signal to the end of the job, stderr)."""
    import threading

    proc = _torchrun(path, 4, "--steps", "100000", "--timeout", "15")
    err = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        for line in proc.stdout:
            if line.startswith("step 2/"):
                break
        else:
            raise AssertionError("the job ended before its second step:\n" + "".join(err)[-3000:])
        os.kill(_rank_pid(proc.pid, victim), sig)
        t0 = time.monotonic()
        proc.stdout.read()
        rc = proc.wait(timeout=120)
        seconds = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()  # the launcher; its workers die with it (pdeathsig) or time out
            proc.wait()
    reader.join(5)
    return rc, seconds, "".join(err)


@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_within_the_timeout(export_dir):
    path, _, _ = export_dir
    rc, seconds, err = _fault(path, signal.SIGSTOP, 2)
    assert rc != 0 and seconds < 60, (rc, seconds, err[-3000:])
    lines = [l for l in err.splitlines() if l.startswith("run.py: error:")]
    assert len(lines) == 1, err[-3000:]
    assert re.match(r"run\.py: error: rank 2 stopped answering .* within --timeout 15s", lines[0]), lines[0]


@pytest.mark.slow
def test_a_killed_rank_ends_the_job(export_dir):
    path, _, _ = export_dir
    rc, seconds, err = _fault(path, signal.SIGKILL, 1)
    assert rc != 0 and seconds < 60, (rc, seconds, err[-3000:])
    # named by run.py's line when a peer notices first, else by torchrun's report of the failure
    assert re.search(r"run\.py: error: rank 1 stopped answering|rank +: 1 \(local_rank: 1\)\s+exitcode +: -9",
                     err), err[-3000:]


@pytest.mark.slow
def test_a_token_outside_the_vocabulary_stops_every_rank_with_one_line(export_dir, tmp_path):
    path, state, _ = export_dir
    vocab = state["embed_tokens.weight"].shape[0]
    proc = _torchrun(path, 4, "--steps", "3", "--data", str(_tokens_with(tmp_path, 4 * 8 + 5, vocab + 7)))
    out, err = proc.communicate(timeout=180)
    assert proc.returncode != 0 and "step 1/3" in out and "step 2/3" not in out, (out, err[-3000:])
    lines = [l for l in err.splitlines() if l.startswith("run.py: error:")]
    assert lines == [f"run.py: error: --data {tmp_path / 'tokens.bin'}: token {vocab + 7} at position 37 is outside "
                     f"the vocabulary of {vocab} ids (the embedding that input_ids indexes)"], err[-3000:]
    assert "IndexError" not in err, err[-3000:]  # (the traceback torchrun prints is its own report)


@pytest.mark.slow
def test_training_runs_end_without_an_abort(tmp_path):
    """Ranks leave the process group together: `--steps 2` without --check exits 0, never with
    "terminate called without an active exception" (SIGABRT). CI runs 3 two-process jobs;
    AUTOSHARD_SHUTDOWN_RUNS=20 AUTOSHARD_SHUTDOWN_NPROC=4 is the full check."""
    from examples.models import llama_tiny

    runs = int(os.environ.get("AUTOSHARD_SHUTDOWN_RUNS", "3"))
    nproc = int(os.environ.get("AUTOSHARD_SHUTDOWN_NPROC", "2"))
    model, args, dims = llama_tiny(with_labels=True)
    mesh, layout = ((Mesh({"dp": 2, "tp": 2}), {"batch": "dp", "heads": "tp", "ffn": "tp"}) if nproc == 4
                    else (Mesh({"tp": nproc}), {"heads": "tp", "ffn": "tp"}))
    plan = autoshard.autoshard(model, args, mesh=mesh, dims=dims, layout=layout)
    path = plan.export(tmp_path / "out", args, reference=False)
    for k in range(runs):
        proc = _torchrun(path, nproc, "--steps", "2")
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"run {k + 1}/{runs}: exit code {proc.returncode}\n{err[-3000:]}"
        assert "terminate called" not in err and "SIGABRT" not in err, f"run {k + 1}/{runs}:\n{err[-3000:]}"
        assert "step 2/2" in out


def test_runpy_converts_a_checkpoint_of_another_float_dtype(export_dir, tmp_path):
    """A float64 checkpoint of a float32 plan loads as model.load_state_dict would (converted):
    the result equals the unsharded model with those weights loaded."""
    src, state, _ = export_dir
    torch.save({k: v.double() if v.is_floating_point() else v for k, v in state.items()}, tmp_path / "c64.pt")
    weights = R.open_weights(src, R.read_plan(src), tmp_path / "c64.pt")
    assert weights.find("embed_tokens.weight").dtype == torch.float32
    for r in simulate_export(src, steps=1, check=True, weights=tmp_path / "c64.pt"):
        assert r["ok"], r["problems"]  # float64 -> float32 gives back the exported float32 values
