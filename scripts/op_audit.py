"""Op audit: capture every architecture the installed ``transformers`` builds from a config at
test size, plus the plain-PyTorch models of ``tests/helpers/plain_models.py``, and list every aten op
that has no sharding rule (``autoshard.passes.rules.rule_for``), by count.

An op without a rule runs replicated (its sharded inputs gathered whole; ``strict=True``
refuses it), so this list is what keeps real models from their layouts. Models that fail to
build, to run, or to capture within the time cap are listed with the reason (first line).

    .venv/bin/python scripts/op_audit.py                     # every model type (slow: minutes)
    .venv/bin/python scripts/op_audit.py llama t5 whisper    # only these model types
    .venv/bin/python scripts/op_audit.py --seconds 20 --skipped
"""
from __future__ import annotations

import argparse
import itertools
import os
import signal
import sys
import time
import warnings
from collections import Counter, defaultdict

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # tests.helpers.plain_models

# Sizes set on every config (and sub-config) that has the attribute: 2 layers, hidden 32, 4 heads.
TINY = dict(
    hidden_size=32, d_model=32, n_embd=32, dim=32, embed_dim=32, n_embed=32, num_hidden_layers=2, n_layer=2,
    num_layers=2, n_layers=2, encoder_layers=2, decoder_layers=2, num_decoder_layers=2, num_attention_heads=4,
    n_head=4, num_heads=4, n_heads=4, encoder_attention_heads=4, decoder_attention_heads=4, num_key_value_heads=2,
    intermediate_size=64, ffn_dim=64, d_ff=64, encoder_ffn_dim=64, decoder_ffn_dim=64, n_inner=64, hidden_dim=64,
    vocab_size=64, max_position_embeddings=64, n_positions=64, head_dim=8, d_kv=8, image_size=32, patch_size=4,
    num_channels=3, num_labels=4, use_cache=False, num_local_experts=4, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    decoder_start_token_id=0, num_mel_bins=16, max_source_positions=32, max_target_positions=32,
    state_size=8, expand=2, conv_kernel=4, time_step_rank=4, mamba_d_state=8, mamba_n_heads=8, mamba_d_head=8,
    tie_word_embeddings=False, type_vocab_size=2, experts_implementation="batched_mm",
)
BATCH, SEQ = 2, 8
# Per-stage sizes of hierarchical (CNN, Swin-like) configs: one block of 16 channels, 2 heads per stage.
TINY_STAGES = dict(depths=1, hidden_sizes=16, num_heads=2, embedding_size=16)
TASKS = ["MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
         "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
         "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
         "MODEL_FOR_CTC_MAPPING_NAMES", "MODEL_MAPPING_NAMES"]
MAX_PARAMS = 5_000_000  # a config whose sizes TINY does not reach is not at test size


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout()


def tiny_config(model_type: str):
    from transformers import AutoConfig, PretrainedConfig
    cfg = AutoConfig.for_model(model_type)
    todo = [cfg]
    while todo:
        c = todo.pop()
        for k, v in TINY.items():
            if hasattr(c, k) and not isinstance(getattr(c, k), (list, dict)):
                try:
                    setattr(c, k, v)
                except Exception:  # a read-only property: leave it
                    pass
        for k, v in TINY_STAGES.items():
            cur = getattr(c, k, None)
            if isinstance(cur, list) and cur:
                setattr(c, k, [v] * len(cur))
            elif k == "embedding_size" and isinstance(cur, int):
                setattr(c, k, v)
        todo += [v for v in vars(c).values() if isinstance(v, PretrainedConfig)]
    return cfg


def model_class(model_type: str):
    from transformers.models.auto import modeling_auto
    import transformers
    for task in TASKS:
        name = getattr(modeling_auto, task).get(model_type)
        if isinstance(name, (tuple, list)):
            name = name[0]
        if name and hasattr(transformers, name):
            return getattr(transformers, name)
    return None


def example_inputs(model, cfg) -> dict:
    """Keyword inputs for the model's main input (tokens, pixels, audio)."""
    g = torch.Generator().manual_seed(0)
    main = getattr(model, "main_input_name", "input_ids")
    if main == "input_ids":
        ids = torch.randint(3, getattr(cfg, "vocab_size", 64) or 64, (BATCH, SEQ), generator=g)
        kw = {"input_ids": ids}
        if getattr(cfg, "is_encoder_decoder", False):
            kw["decoder_input_ids"] = ids
        return kw
    if main == "pixel_values":
        size = getattr(cfg, "image_size", 32)
        size = size[0] if isinstance(size, (list, tuple)) else size
        return {"pixel_values": torch.randn(BATCH, getattr(cfg, "num_channels", 3), size, size, generator=g)}
    if main == "input_features":
        kw = {"input_features": torch.randn(BATCH, getattr(cfg, "num_mel_bins", 16),
                                            2 * getattr(cfg, "max_source_positions", 32), generator=g)}
        if getattr(cfg, "is_encoder_decoder", False):
            kw["decoder_input_ids"] = torch.randint(3, cfg.vocab_size, (BATCH, SEQ), generator=g)
        return kw
    if main == "input_values":
        return {"input_values": torch.randn(BATCH, 1600, generator=g)}
    raise ValueError(f"main input {main!r} not handled")


def missing_ops(model, args, kwargs) -> Counter:
    from autoshard.passes.capture import capture
    from autoshard.passes.rules import rule_for
    cap = capture(model, args, kwargs)
    return Counter(str(n.target) for n in cap.graph.nodes
                   if n.op == "call_function" and rule_for(n.target) is None
                   and str(n.target) != "<built-in function getitem>")


def hf_models(names, seconds):
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    transformers.logging.set_verbosity_error()
    for model_type in names or list(CONFIG_MAPPING_NAMES):
        signal.alarm(seconds)
        t0 = time.perf_counter()
        try:
            cls = model_class(model_type)
            if cls is None:
                yield model_type, None, "no model class for token, image or audio inputs"
                continue
            cfg = tiny_config(model_type)
            torch.manual_seed(0)
            model = cls(cfg).eval()
            n = sum(p.numel() for p in model.parameters())
            if n > MAX_PARAMS:
                yield model_type, None, f"{n / 1e6:.0f}M parameters at the sizes set: not at test size"
                continue
            kwargs = example_inputs(model, cfg)
            with torch.no_grad():
                model(**kwargs)
            yield model_type, missing_ops(model, (), kwargs), f"{cls.__name__} {time.perf_counter() - t0:.1f}s"
        except Timeout:
            yield model_type, None, f"over {seconds}s"
        except Exception as e:  # noqa: BLE001 (any failure is a line of the report)
            first = (str(e).strip().splitlines() or [""])[0]
            yield model_type, None, f"{type(e).__name__}: {first[:140]}"
        finally:
            signal.alarm(0)


def plain_models():
    from tests.helpers import plain_models as pm
    for name, build in (("plain gpt", pm.gpt), ("plain mha_encoder", pm.mha_encoder), ("plain cnn", pm.cnn),
                        ("plain cnn (train)", lambda: pm.cnn(train=True))):
        model, args, _ = build()
        try:
            yield name, missing_ops(model, args, {}), type(model).__name__
        except Exception as e:  # noqa: BLE001
            yield name, None, f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:140]}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_types", nargs="*", help="transformers model types (default: every one)")
    ap.add_argument("--seconds", type=int, default=30, help="time cap per model (build, run, capture)")
    ap.add_argument("--skipped", action="store_true", help="also list the models skipped, with the reason")
    ap.add_argument("--start", default="", help="begin at this model type (alphabetical order), to resume")
    ap.add_argument("--no-plain", action="store_true", help="leave out tests/helpers/plain_models.py")
    opts = ap.parse_args(argv)
    signal.signal(signal.SIGALRM, _alarm)
    warnings.filterwarnings("ignore")
    ops, models = Counter(), defaultdict(list)
    captured, skipped = [], []
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    names = opts.model_types or [t for t in sorted(CONFIG_MAPPING_NAMES) if t >= opts.start]
    # The plain models first: their capture imports what every capture needs, so that a time cap
    # never interrupts an import half done (a half-imported module breaks every later capture).
    sources = hf_models(names, opts.seconds)
    if not opts.no_plain:
        sources = itertools.chain(plain_models(), sources)
    for name, missing, note in sources:
        if missing is None:
            skipped.append((name, note))
            print(f"  skipped {name}: {note}", file=sys.stderr, flush=True)
            continue
        captured.append((name, note))
        print(f"  captured {name} ({note}): {sum(missing.values())} nodes without a rule {dict(missing)}",
              file=sys.stderr, flush=True)
        ops.update(missing)
        for op in missing:
            models[op].append(name)
    from tabulate import tabulate
    print(f"\n{len(captured)} models captured, {len(skipped)} skipped")
    rows = [(op, n, len(models[op]), ", ".join(models[op][:6]) + (" ..." if len(models[op]) > 6 else ""))
            for op, n in ops.most_common()]
    print(tabulate(rows, headers=["op without a rule", "nodes", "models", "in"]))
    if opts.skipped:
        print()
        print(tabulate(skipped, headers=["skipped", "why"]))


if __name__ == "__main__":
    main()
