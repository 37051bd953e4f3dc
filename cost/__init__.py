"""Cost model: hardware, communication, compute and memory (imported as ``autoshard.cost``)."""
from .comm import (
    COLLECTIVE_KINDS,
    collective_bytes,
    collective_formula,
    collective_steps_formula,
    collective_time,
    collective_time_formula,
)
from .compute import (
    attention_flops,
    elementwise_bytes,
    elementwise_flops,
    matmul_bytes,
    matmul_flops,
    roofline_time,
)
from .hardware import PRESETS, DeviceSpec, Hardware, LinkSpec, load_hardware, normalize_dtype, save_hardware
from .memory import ModelState, activation_bytes, kv_cache_bytes, model_state_bytes
from .pipeline import bubble_fraction, bubble_overhead
from .experts import tokens_per_expert
from autoshard.cost.context_parallel import (ContextEstimate, causal_pairs_per_rank, context_parallel_estimate, online_softmax_merge)

__all__ = [
    # hardware
    "LinkSpec", "DeviceSpec", "Hardware", "PRESETS", "load_hardware", "save_hardware", "normalize_dtype",
    # communication
    "COLLECTIVE_KINDS", "collective_bytes", "collective_time", "collective_formula",
    "collective_steps_formula", "collective_time_formula",
    # compute
    "matmul_flops", "matmul_bytes", "attention_flops", "elementwise_flops", "elementwise_bytes",
    "roofline_time",
    # memory
    "ModelState", "model_state_bytes", "kv_cache_bytes", "activation_bytes",
    # pipeline
    "bubble_fraction", "bubble_overhead",
    # expert parallelism
    "tokens_per_expert",
    # context parallelism
    "online_softmax_merge", "causal_pairs_per_rank", "context_parallel_estimate", "ContextEstimate",
]

# Graph cost model, layout search and calibration (see cost/model.py, cost/search.py).
from .model import CostModel, PlanCost, program_cost, resolve_cost_model  # noqa: E402
from .search import SearchResult, SearchSpace, factorizations, plan_search, search_layout  # noqa: E402
from .calibrate import calibrate  # noqa: E402

__all__ += ["CostModel", "PlanCost", "program_cost", "resolve_cost_model", "SearchSpace", "SearchResult",
            "search_layout", "plan_search", "factorizations", "calibrate"]
