"""Hugging Face architectures, tried as a new user would: tiny models built from their configs
(``tests/helpers/hf_zoo.py``: random weights, no downloads), the dims a user names, and the layouts an
expert asks for. Every plan must equal the unsharded model (forward and every gradient) and use
the collectives an expert would write:

- data parallel (``batch=dp``): nothing gathered on dp in forward; the only forward dp
  collectives are the loss's two all-reduces (sum of token losses, count of valid tokens);
- Megatron tensor parallel on top (heads/ffn on tp): no forward gather at all, and per block
  the textbook number of forward tp all-reduces (2 per layer; 1 for parallel attention+MLP
  blocks; 3 in a T5 decoder layer).
"""
from __future__ import annotations

import re
import warnings
from collections import Counter

import pytest
import torch

pytest.importorskip("transformers")

import autoshard
from autoshard import LayoutError, Mesh
from autoshard.ownership import Shard
from autoshard.passes.experts import MoEWarning

from tests.helpers import hf_zoo
from tests.helpers.hf_zoo import ARCHS, ZOO, TOKENS as TOKEN_DIMS

# Every architecture of the zoo; the first eleven are the most used decoders and encoders.
EXACT = ["llama", "qwen3", "gemma2", "phi3", "gpt_neox", "gpt2", "bert", "t5", "vit", "mixtral", "qwen2_moe",
         "mistral", "qwen2", "gemma", "gemma3", "phi", "opt", "olmoe"]


@pytest.fixture(scope="module")
def built():
    """One model per architecture (and its unsharded loss, logits and gradients), built once."""
    cache = {}

    def get(name):
        if name not in cache:
            model, kwargs = {**ARCHS, **ZOO}[name].build()
            model.zero_grad()
            out = model(**kwargs)
            out.loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            cache[name] = (model, kwargs, out.loss.detach(), out.logits.detach(), grads)
        return cache[name]

    return get


def plan_for(name, model, kwargs, layout, mesh, strict=True, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("error", autoshard.UnsupportedOpWarning)  # every op has a rule
        warnings.simplefilter("error", MoEWarning)  # a dense model's block list is not taken for experts
        # strict: a value the layout shards may not be gathered whole in forward anywhere
        return autoshard.autoshard(model, (), kwargs, mesh=Mesh(mesh), dims={**ARCHS, **ZOO}[name].all_dims,
                                   layout=layout, strict=strict, **options)


def assert_exact(plan, kwargs, loss, logits, grads):
    out, got = plan.simulate_grads(**kwargs)
    torch.testing.assert_close(out.loss, loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.logits, logits, rtol=1e-5, atol=1e-6)
    assert set(grads) <= set(got)
    for n, g in grads.items():
        # fp32 sums over 2-4 ranks in another order: a few ulps on gradients that are sums of many terms
        torch.testing.assert_close(got[n], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


def assert_exact_to_spread(plan, model, kwargs, loss, logits, grads):
    """assert_exact's bounds, with test_property.close's fallback where they fail: the plan may be
    at most 10x as far from the float64 reference as the single-device float32 result is (a
    gradient summed over the split batch, e.g. a position table's, rounds in another order)."""
    import copy
    from tests.helpers.exactness import close
    f64 = []

    def exact(key):
        def get():
            if not f64:
                m = copy.deepcopy(model).double()
                m.zero_grad()
                out = m(**{k: v.double() if v.is_floating_point() else v for k, v in kwargs.items()})
                out.loss.backward()
                f64.append(({"loss": out.loss.detach(), "logits": out.logits.detach()},
                            {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
            return f64[0][0][key[1]] if key[0] == "out" else f64[0][1][key[1]]
        return get

    out, got = plan.simulate_grads(**kwargs)
    close(out.loss, loss, "loss", exact(("out", "loss")))
    close(out.logits, logits, "logits", exact(("out", "logits")))
    assert set(grads) <= set(got)
    for n, g in grads.items():
        close(got[n], g, f"grad of {n}", exact(("grad", n)))


def forward(plan, kind=None, axis=None):
    return [c for c in plan.collectives if c.phase == "forward" and (kind is None or c.kind == kind)
            and (axis is None or c.axes == (axis,))]


def per_block(collectives, prefix):
    counts = Counter()
    for c in collectives:
        m = re.match(re.escape(prefix) + r"\.(\d+)(\.|$)", c.where)
        counts[int(m.group(1)) if m else None] += 1
    return counts


@pytest.mark.parametrize("name", EXACT)
def test_dp_and_megatron_plans_are_exact_with_textbook_collectives(name, built):
    model, kwargs, loss, logits, grads = built(name)
    arch = ARCHS[name]

    dp = plan_for(name, model, kwargs, {"batch": "dp"}, {"dp": 2})
    assert_exact(dp, kwargs, loss, logits, grads)
    fwd = forward(dp)
    assert all(c.kind == "all_reduce" for c in fwd), [(c.kind, c.where, c.why) for c in fwd]
    assert len(fwd) <= 2, [c.why for c in fwd]  # the loss: sum and count, nothing else
    # the loss's sum is returned pending (passes/output_sums.py): forward does not wait for it
    assert dp.graph_module.code.count("lazy = True") == 1

    tp = plan_for(name, model, kwargs, {"batch": "dp", **arch.tp_layout}, {"dp": 2, "tp": 2}, captured=dp.captured)
    assert_exact(tp, kwargs, loss, logits, grads)
    assert not forward(tp, "all_gather"), [(c.axes, c.where, c.why) for c in forward(tp, "all_gather")]
    assert len(forward(tp, axis="dp")) <= 2
    assert_tp_reduces_per_block(tp, arch)
    # eval mode: dropout is the identity and never the reason for a collective
    assert not [c.why for c in dp.collectives + tp.collectives if "dropout needs" in c.why]


def assert_tp_reduces_per_block(plan, arch):
    """Forward tp all-reduces: the recorded count in every block (an architecture may record the
    counts it accepts, as a tuple), none outside the blocks."""
    reduces = forward(plan, "all_reduce", "tp")
    if arch.tp_block_outputs:  # one per block, read by the next block's input norm or the final norm
        readers = sorted(c.where for c in reduces)
        norms = [m for m, _ in plan.model.named_modules() if m.endswith(("input_layernorm", "model.norm"))]
        assert len(reduces) == hf_zoo.LAYERS and set(readers) <= set(norms), readers
        return
    counted = 0
    for prefix, k in arch.tp_reduces.items():
        blocks = per_block(reduces, prefix)
        blocks.pop(None, None)
        assert sorted(blocks) == list(range(hf_zoo.LAYERS)), (prefix, blocks)
        accepted = set(k) if isinstance(k, tuple) else {k}
        assert len(set(blocks.values())) == 1 and set(blocks.values()) <= accepted, \
            (prefix, blocks, [(c.where, c.why) for c in reduces])
        counted += sum(blocks.values())
    assert counted == len(reduces), [(c.where, c.why) for c in reduces]


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_megatron_plan_is_exact_with_textbook_collectives(name, built):
    """The rest of the zoo, one plan each (dp=2 x tp=2, batch on dp, the Megatron layout on tp):
    exact, nothing gathered in forward (strict), the loss's two dp sums, the recorded tp
    all-reduces per block. An architecture recorded as not strict is planned without strict, and
    its plan must name the op that gathers (README's supported-models table lists it)."""
    model, kwargs, loss, logits, grads = built(name)
    arch = ZOO[name]
    strict = not arch.not_strict
    tp = plan_for(name, model, kwargs, {"batch": "dp", **arch.tp_layout}, {"dp": 2, "tp": 2}, strict=strict)
    assert_exact_to_spread(tp, model, kwargs, loss, logits, grads)
    if strict:
        assert not forward(tp, "all_gather"), [(c.axes, c.where, c.why) for c in forward(tp, "all_gather")]
    else:
        assert tp.unsharded and all(f"needs that dim whole" in u.why and f" {arch.not_strict} " in u.why
                                    for u in tp.unsharded), tp.unsharded
    assert len(forward(tp, "all_reduce", "dp")) <= 2
    assert_tp_reduces_per_block(tp, arch)


@pytest.mark.parametrize("zero_stage", [2, 3])
@pytest.mark.parametrize("name", ["gpt2", "bert", "t5"])
def test_sharded_state_sums_position_tables_once(name, zero_stage, built):
    """Position tables (GPT-2's wpe, BERT's position embeddings, T5's relative attention bias)
    are read by replicated work: under ZeRO-2 their gradients once came out twice too large.
    Their sum over the data axis is the sharded state's reduce-scatter, nothing else."""
    model, kwargs, loss, logits, grads = built(name)
    plan = plan_for(name, model, kwargs, {"batch": "dp"}, {"dp": 2}, train=True, zero_stage=zero_stage)
    assert not [c.why for c in plan.collectives if c.phase == "backward" and c.kind == "all_reduce"]
    assert_exact(plan, kwargs, loss, logits, grads)


def test_one_name_on_two_dims_of_different_sizes_is_an_error(built):
    """Qwen3's q_norm/k_norm (head_dim 8) match the glob "*norm.weight" meant for hidden (32)."""
    model, kwargs, *_ = built("qwen3")
    dims = {**ARCHS["qwen3"].all_dims, "*norm.weight": "hidden"}
    del dims["*.q_norm.weight"], dims["*.k_norm.weight"]
    with pytest.raises(LayoutError) as e:
        autoshard.autoshard(model, (), kwargs, mesh=Mesh({"tp": 2}), dims=dims, layout={"hidden": "tp"})
    msg = str(e.value)
    assert "'hidden'" in msg and "size 8" in msg and "size 32" in msg and "norm.weight" in msg, msg


def test_a_tied_parameter_answers_to_both_names(built):
    """Gemma ties lm_head.weight to model.embed_tokens.weight; torch.export lists one of them."""
    model, kwargs, loss, logits, grads = built("gemma")
    dims = {**TOKEN_DIMS, "lm_head.weight": "vocab hidden"}
    plan = autoshard.autoshard(model, (), kwargs, mesh=Mesh({"tp": 2}), dims=dims, layout={"vocab": "tp"})
    assert plan.captured.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert plan.placement_of("model.embed_tokens.weight")[0] == Shard(0)
    _, got = plan.simulate_grads(**kwargs)
    torch.testing.assert_close(got["lm_head.weight"], grads["model.embed_tokens.weight"], rtol=1e-5, atol=1e-6)


def test_a_capture_failure_is_one_line_with_a_way_forward(capfd):
    """Mixtral with experts_implementation="eager" loops over the experts that got tokens, which
    torch.export cannot capture: the error names the source line and the configs that work, and
    torch's partial-graph dump (hundreds of lines on stderr) is held back."""
    import dataclasses
    arch = dataclasses.replace(ARCHS["mixtral"], config=dict(ARCHS["mixtral"].config, experts_implementation="eager"))
    model, kwargs = arch.build()
    with pytest.raises(autoshard.CaptureError) as e:
        autoshard.autoshard(model, (), kwargs, mesh=Mesh({"dp": 2}), dims=arch.all_dims, layout={"batch": "dp"})
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert "MixtralForCausalLM" in msg and "modeling_mixtral.py:" in msg and "expert_hit" in msg, msg
    assert 'experts_implementation="grouped_mm" or "batched_mm"' in msg, msg
    assert e.value.__suppress_context__
    out, err = capfd.readouterr()
    assert "def forward" not in out + err and len((out + err).splitlines()) < 5, (out + err)[:500]


class _FlipThenLinear(torch.nn.Module):
    """x -> flip (an op without a sharding rule) -> linear: the batch path runs through it."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(6, 6)

    def forward(self, x):
        return self.proj(torch.flip(x, dims=[-1])).square().sum()


def test_a_rule_less_op_on_the_batch_path_is_reported_and_strict_refuses_it():
    """Item 1: what the layout asks (batch on dp) but the plan does not do (flip has no rule, so x
    is gathered whole and every rank computes the whole batch) is shown in print(plan) and
    plan.explain() with the op, module, line and bytes, and strict=True makes it an error."""
    torch.manual_seed(0)
    model, x = _FlipThenLinear(), torch.randn(4, 6)
    kw = dict(mesh=Mesh({"dp": 2}), dims={"x": "batch hidden"}, layout={"batch": "dp"})
    with pytest.warns(autoshard.UnsupportedOpWarning):
        plan = autoshard.autoshard(model, (x,), **kw)
    [lapse] = plan.unsharded
    assert (lapse.dim, lapse.axis, lapse.value, lapse.bytes) == ("batch", "dp", "x", 2 * 6 * 4)
    assert "test_hf_models.py" in lapse.line and "aten.flip" in lapse.why
    text = str(plan)
    assert "Not sharded as the layout asks (1 forward gathers" in text and "test_hf_models.py" in text
    assert "Not sharded as the layout asks: 1 forward gather(s), 48 bytes/rank" in plan.explain()
    out, _ = plan.simulate_grads(x)
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)
    with pytest.warns(autoshard.UnsupportedOpWarning), pytest.raises(LayoutError, match=r"strict: .*'batch'.*flip"):
        autoshard.autoshard(model, (x,), strict=True, captured=plan.captured, **kw)


def test_forward_only_plans_do_not_list_backward_collectives_and_errors_name_inferred_dims(built):
    """Item 7: print(plan) of a train=False plan lists what its forward runs; a train=True plan
    lists backward too. An unknown layout dim is answered with a real inferred name as example."""
    model, kwargs, *_ = built("llama")
    layout = {"batch": "dp", **ARCHS["llama"].tp_layout}
    fwd = plan_for("llama", model, kwargs, layout, {"dp": 2, "tp": 2})
    table = str(fwd).split("\nCollectives (")[1].split("\n\n")[0]
    n_bwd = sum(c.phase == "backward" for c in fwd.collectives)
    row = re.compile(r"^\s*\d+\s+backward\s", re.M)  # a table row whose phase is backward
    assert n_bwd and re.search(r"^\s*\d+\s+forward\s", table, re.M) and not row.search(table)
    assert f"the {n_bwd} backward collectives" in table
    trained = plan_for("llama", model, kwargs, layout, {"dp": 2, "tp": 2}, captured=fwd.captured, train=True)
    assert row.search(str(trained).split("\nCollectives (")[1])
    with pytest.raises(LayoutError) as e:
        plan_for("llama", model, kwargs, {"bogus": "tp"}, {"tp": 2}, captured=fwd.captured)
    example = re.search(r"inferred names such as '([^']+)'", str(e.value)).group(1)
    assert ":" in example and example not in {"batch", "seq", "hidden", "heads", "kv_heads", "ffn", "vocab"}


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_context_and_sequence_parallel_on_hugging_face_decoders(built, name):
    """Ring attention (seq on cp) and Megatron sequence parallelism (seq soft on tp) on the
    Hugging Face decoders themselves, not only our Llama: exact loss, logits and gradients."""
    model, kwargs, loss, logits, grads = built(name)
    cp = autoshard.autoshard(model, (), kwargs, mesh=Mesh({"cp": 2}), dims=ARCHS[name].all_dims, layout={"seq": "cp"},
                            context={"variant": "ring"})  # the cost model picks the gather at this length
    assert any(c.op == "ring_attention" for c in cp.collectives)
    assert_exact(cp, kwargs, loss, logits, grads)
    sp = autoshard.autoshard(model, (), kwargs, mesh=Mesh({"tp": 2}), dims=ARCHS[name].all_dims,
                             layout={"heads": "tp", "kv_heads": "tp", "ffn": "tp", "seq": "tp?"})
    assert forward(sp, "reduce_scatter", "tp") and not forward(sp, "all_reduce", "tp")
    assert_exact(sp, kwargs, loss, logits, grads)


def test_sequence_parallel_training_runtime_passes_on_a_hugging_face_decoder(built):
    """Training Llama (transformers) with sequence parallelism: the gathers read only by linears
    are fused with them (their reduce-scatter overlapped) and the norm weights' gradient sums land
    after backward, bit for bit the program without those passes, and exact."""
    from autoshard.runtime.primitives.overlap_linear import varying_linears

    model, kwargs, loss, logits, grads = built("llama")
    opts = dict(mesh=Mesh({"tp": 2}), dims=ARCHS["llama"].all_dims, train=True,
                layout={"heads": "tp", "kv_heads": "tp", "ffn": "tp", "seq": "tp?"})
    sp = autoshard.autoshard(model, (), kwargs, **opts)
    nodes = list(sp.graph_module.graph.nodes)
    assert [n for n in nodes if n.target is varying_linears and n.kwargs.get("gather_dim") is not None]
    assert [n for n in nodes if n.kwargs.get("later")]
    plain = autoshard.autoshard(model, (), kwargs, **opts, disable_passes=("overlap_linear", "param_sums"))
    out, got = sp.simulate_grads(**kwargs)
    ref_out, ref = plain.simulate_grads(**kwargs)
    assert torch.equal(out.loss, ref_out.loss) and got.keys() == ref.keys()
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    assert_exact(sp, kwargs, loss, logits, grads)


@pytest.mark.parametrize("name", ["llama", "gemma", "gpt2", "qwen2"])
def test_vocab_parallel_cross_entropy_on_hugging_face_models(built, name):
    """The output head split by vocab on tp: Hugging Face's loss (its own shift, upcast and
    flatten before cross_entropy) runs on the split logits (row maxima gathered, sums of exp
    and target logits all-reduced) instead of gathering them, and stays exact. No logits are
    gathered in forward."""
    model, kwargs, loss, logits, grads = built(name)
    # not strict: the input embedding, split by vocab too, is gathered for its lookup
    plan = autoshard.autoshard(model, (), kwargs, mesh=Mesh({"tp": 2}), dims=ARCHS[name].all_dims,
                               layout={**ARCHS[name].tp_layout, "vocab": "tp"})
    lowered = [c for c in plan.collectives if c.op == "vocab_parallel_cross_entropy"]
    assert sorted(c.kind for c in lowered) == ["all_gather", "all_reduce"], [c.why for c in plan.collectives]
    others = [c for c in forward(plan, "all_gather") if c.op != "vocab_parallel_cross_entropy"]
    assert all("embed" in c.where or "wte" in c.where for c in others), [(c.where, c.why) for c in others]
    assert_exact(plan, kwargs, loss, logits, grads)


def test_t5_shifting_its_labels_with_the_decoder_sequence_split(built):
    """T5 builds its decoder inputs from ``labels`` by slice and index writes (``_shift_right``);
    with the decoder sequence split those writes land on the ranks owning the positions, and
    loss, logits and every gradient equal the unsharded model's (before writes were made
    functional at capture, the loss came out 5.169 against 4.904)."""
    model, kwargs, loss, logits, grads = built("t5")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autoshard.UnsupportedOpWarning)
        plan = autoshard.autoshard(model, (), kwargs, mesh=Mesh({"dp": 2, "tp": 2}),
                                   dims={**ARCHS["t5"].all_dims, "labels": "batch tseq"},
                                   layout={"batch": "dp", "tseq": "tp"})
    assert_exact(plan, kwargs, loss, logits, grads)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "olmoe"])
def test_expert_parallel_plans_of_the_moe_models_are_strict_and_exact(name, built):
    """README's EP layout (batch on dp and ep, experts on ep) on the MoE models as the zoo builds
    and names them (``batched_mm`` experts, the router's weight named ``experts hidden``): every
    MoE layer recognised, strict, exact, the routers whole on ep and the experts split there."""
    model, kwargs, loss, logits, grads = built(name)
    plan = plan_for(name, model, kwargs, {"batch": ("dp", "ep"), "experts": "ep"}, {"dp": 2, "ep": 2})
    assert [p.region.form for p in plan.program.experts] == ["batched"] * hf_zoo.LAYERS
    for n, _ in model.named_parameters():
        if n.endswith("mlp.gate.weight") or ".experts." in n:
            assert str(plan.placement_of(n)[1]) == ("R" if n.endswith("gate.weight") else "S(0)"), n
    assert_exact(plan, kwargs, loss, logits, grads)
