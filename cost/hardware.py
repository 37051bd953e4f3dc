"""Hardware description: which link each mesh axis uses, and what each device can do.

A :class:`Hardware` is a device (peak FLOP/s per dtype, memory bandwidth and capacity) plus a
list of link tiers, fastest first. Each tier has a *domain size*: ranks ``[k*S, (k+1)*S)``
share that tier (a scale-up domain such as an NVLink node); the last tier (``domain_size=None``)
connects everything. A mesh axis uses the fastest tier whose domains contain every one of its
groups, given the mesh shape and the row-major rank layout (the last axis is innermost, as in
torch's ``init_device_mesh`` and :class:`autoshard.Mesh`).

Example::

    >>> hw = load_hardware("h100")
    >>> {a: l.name for a, l in hw.axis_links({"dp": 4, "pp": 2, "tp": 8}).items()}
    {'dp': 'infiniband', 'pp': 'infiniband', 'tp': 'nvlink'}

Presets hold spec-sheet numbers with all efficiencies at 1.0; calibration (measured achieved
rates) should replace them. ``save_hardware`` / ``load_hardware`` read and write JSON.
"""
from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping

__all__ = [
    "LinkSpec",
    "DeviceSpec",
    "Hardware",
    "PRESETS",
    "load_hardware",
    "save_hardware",
    "normalize_dtype",
]

_DTYPE_ALIASES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
    "float64": "fp64",
    "double": "fp64",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "float8": "fp8",
}


def normalize_dtype(dtype: Any) -> str:
    """Short dtype key used in ``DeviceSpec.peak_flops`` (accepts torch dtypes and names).

    >>> normalize_dtype("torch.bfloat16"), normalize_dtype("float32"), normalize_dtype("bf16")
    ('bf16', 'fp32', 'bf16')
    """
    s = str(dtype).lower()
    if s.startswith("torch."):
        s = s[len("torch."):]
    return _DTYPE_ALIASES.get(s, s)


@dataclass(frozen=True)
class LinkSpec:
    """One class of link.

    ``bandwidth``: bytes/s per rank *per direction* (a ring step sends and receives at once, so
    the one-direction rate is what bounds it). ``latency``: seconds per algorithm step (the
    alpha of the alpha-beta model). ``domain_size``: ranks per domain sharing this link, ``None``
    for the tier that reaches every rank. ``efficiency``: achieved fraction of ``bandwidth``.

    >>> LinkSpec(400e9).effective_bandwidth
    400000000000.0
    """

    bandwidth: float
    latency: float = 0.0
    domain_size: int | None = None
    name: str = "link"
    efficiency: float = 1.0

    def __post_init__(self):
        if not self.bandwidth > 0:
            raise ValueError(f"link {self.name!r}: bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")
        if not self.latency >= 0:
            raise ValueError(f"link {self.name!r}: latency must be >= 0 s, got {self.latency!r}")
        if self.domain_size is not None and (not isinstance(self.domain_size, int) or self.domain_size < 1):
            raise ValueError(f"link {self.name!r}: domain_size must be a positive int or None, got {self.domain_size!r}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"link {self.name!r}: efficiency must be in (0, 1], got {self.efficiency!r}")

    @property
    def effective_bandwidth(self) -> float:
        return self.bandwidth * self.efficiency


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: peak FLOP/s by dtype, HBM (or DRAM) bandwidth in bytes/s, capacity in bytes.

    ``flops_efficiency`` / ``mem_efficiency`` are the achieved fractions of peak used by the
    roofline (see :func:`autoshard.cost.roofline_time`).

    >>> DeviceSpec("toy", {"bf16": 1e12}, 1e11, 8e9).flops("torch.bfloat16")
    1000000000000.0
    """

    name: str
    peak_flops: Mapping[str, float] = field(hash=False)
    mem_bandwidth: float
    mem_capacity: float
    flops_efficiency: float = 1.0
    mem_efficiency: float = 1.0
    # Fixed seconds per op launch (Python dispatch / kernel launch); 0 in the presets, set by
    # calibration where small ops are overhead-bound (CPU eager mode).
    op_overhead: float = 0.0

    def __post_init__(self):
        flops = {normalize_dtype(k): float(v) for k, v in dict(self.peak_flops).items()}
        if not flops or any(v <= 0 for v in flops.values()):
            raise ValueError(f"device {self.name!r}: peak_flops needs positive FLOP/s per dtype, got {self.peak_flops!r}")
        object.__setattr__(self, "peak_flops", flops)
        for attr in ("mem_bandwidth", "mem_capacity"):
            if not getattr(self, attr) > 0:
                raise ValueError(f"device {self.name!r}: {attr} must be > 0, got {getattr(self, attr)!r}")
        for attr in ("flops_efficiency", "mem_efficiency"):
            if not 0 < getattr(self, attr) <= 1:
                raise ValueError(f"device {self.name!r}: {attr} must be in (0, 1], got {getattr(self, attr)!r}")
        if not self.op_overhead >= 0:
            raise ValueError(f"device {self.name!r}: op_overhead must be >= 0 s, got {self.op_overhead!r}")

    def flops(self, dtype: Any = "bf16") -> float:
        """Peak FLOP/s for ``dtype``; a ValueError names the dtypes this device lists."""
        key = normalize_dtype(dtype)
        if key not in self.peak_flops:
            raise ValueError(f"device {self.name!r} has no peak FLOP/s for dtype {key!r}; it lists {sorted(self.peak_flops)}")
        return self.peak_flops[key]


def _mesh_items(mesh: Any) -> tuple[tuple[str, int], ...]:
    # Duck-typed so cost/ needs no import of the runtime: a dict, an autoshard.Mesh (.axes),
    # a torch DeviceMesh (mesh_dim_names + .mesh.shape) or a sequence of (name, size) pairs.
    if isinstance(mesh, Mapping):
        items = tuple(mesh.items())
    elif isinstance(getattr(mesh, "axes", None), Mapping):
        items = tuple(mesh.axes.items())
    elif getattr(mesh, "mesh_dim_names", None):
        items = tuple(zip(mesh.mesh_dim_names, tuple(mesh.mesh.shape)))
    else:
        items = tuple((n, s) for n, s in mesh)
    for n, s in items:
        if not isinstance(s, int) or s < 1:
            raise ValueError(f"mesh axis {n!r} has size {s!r}; sizes must be positive integers")
    return tuple((str(n), int(s)) for n, s in items)


@lru_cache(maxsize=4096)
def _groups_fit(items: tuple[tuple[str, int], ...], axes: frozenset, domain: int) -> bool:
    """Whether every group varying over ``axes`` lies inside one block of ``domain`` ranks."""
    sizes = [s for _, s in items]
    strides = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
    inside = [i for i, (n, _) in enumerate(items) if n in axes]
    # A group's members lie between its lowest rank (all its axis coords 0) and that plus
    # `span`; blocks are contiguous, so the group fits iff those two ranks share a block.
    span = sum((sizes[i] - 1) * strides[i] for i in inside)
    if span >= domain:
        return False
    outside = [i for i in range(len(sizes)) if i not in inside]
    for coords in itertools.product(*(range(sizes[i]) for i in outside)):
        base = sum(c * strides[i] for c, i in zip(coords, outside))
        if base // domain != (base + span) // domain:
            return False
    return True


@dataclass(frozen=True)
class Hardware:
    """A device type plus link tiers (fastest first; the last has ``domain_size=None``).

    ``axis_links`` pins mesh axis names to link names when the rank layout is not row-major
    (e.g. a launcher that places the ``tp`` axis across nodes on purpose).

    >>> hw = load_hardware("h100")
    >>> hw.link_for_axis({"dp": 8, "tp": 8}, "tp").name, hw.link_for_axis({"dp": 8, "tp": 8}, "dp").name
    ('nvlink', 'infiniband')
    """

    name: str
    device: DeviceSpec
    links: tuple[LinkSpec, ...]
    pinned: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self):
        links = tuple(self.links)
        if not links:
            raise ValueError(f"hardware {self.name!r} needs at least one link")
        if links[-1].domain_size is not None:
            raise ValueError(f"hardware {self.name!r}: the last link ({links[-1].name!r}) must reach every rank (domain_size=None)")
        if any(l.domain_size is None for l in links[:-1]):
            raise ValueError(f"hardware {self.name!r}: only the last link may have domain_size=None")
        sizes = [l.domain_size for l in links[:-1]]
        if sizes != sorted(sizes):
            raise ValueError(f"hardware {self.name!r}: links must be ordered by increasing domain_size, got {sizes}")
        names = [l.name for l in links]
        if len(set(names)) != len(names):
            raise ValueError(f"hardware {self.name!r}: link names must be unique, got {names}")
        for axis, link in dict(self.pinned).items():
            if link not in names:
                raise ValueError(f"hardware {self.name!r}: axis {axis!r} pinned to unknown link {link!r}; links are {names}")
        object.__setattr__(self, "links", links)
        object.__setattr__(self, "pinned", dict(self.pinned))

    def link(self, name: str) -> LinkSpec:
        """The link tier called ``name``."""
        for l in self.links:
            if l.name == name:
                return l
        raise ValueError(f"hardware {self.name!r} has no link {name!r}; it has {[l.name for l in self.links]}")

    def link_for_axes(self, mesh: Any, axes: str | Iterable[str]) -> LinkSpec:
        """Link used by a collective over ``axes`` (one name or several) of ``mesh``.

        A group over several axes is as slow as its slowest member: a pinned axis forces at
        least its pinned tier.

        >>> load_hardware("h100").link_for_axes({"dp": 2, "tp": 4}, ("dp", "tp")).name
        'nvlink'
        """
        items = _mesh_items(mesh)
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        known = [n for n, _ in items]
        for a in axes:
            if a not in known:
                raise ValueError(f"unknown mesh axis {a!r}; this mesh has axes {known}")
        floor = max((self._tier(self.pinned[a]) for a in axes if a in self.pinned), default=0)
        for i, l in enumerate(self.links):
            if i < floor:
                continue
            if l.domain_size is None or _groups_fit(items, frozenset(axes), l.domain_size):
                return l
        raise AssertionError("unreachable: the last link reaches every rank")

    def link_for_axis(self, mesh: Any, axis: str) -> LinkSpec:
        """Link used by collectives along one mesh ``axis`` (see :meth:`link_for_axes`)."""
        return self.link_for_axes(mesh, (axis,))

    def axis_links(self, mesh: Any) -> dict[str, LinkSpec]:
        """``{axis: LinkSpec}`` for every axis of ``mesh``."""
        return {n: self.link_for_axis(mesh, n) for n, _ in _mesh_items(mesh)}

    def _tier(self, name: str) -> int:
        return [l.name for l in self.links].index(name)

    # -- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Plain-JSON form (the format :func:`load_hardware` reads)."""
        d = {
            "name": self.name,
            "device": {**asdict(self.device), "peak_flops": dict(self.device.peak_flops)},
            "links": [asdict(l) for l in self.links],
        }
        if self.pinned:
            d["pinned"] = dict(self.pinned)
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "Hardware":
        """Inverse of :meth:`to_dict`; unknown keys raise ValueError rather than being ignored."""
        try:
            return cls(
                name=d["name"],
                device=DeviceSpec(**d["device"]),
                links=tuple(LinkSpec(**l) for l in d["links"]),
                pinned=d.get("pinned", {}),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"bad hardware description: {e}") from None


# ---------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------

# NVIDIA H100 SXM5 80GB (H100 Tensor Core GPU datasheet; DGX H100 user guide):
H100_SXM = DeviceSpec(
    name="H100-SXM5-80GB",
    peak_flops={
        # Datasheet tensor-core figures are quoted "with sparsity"; dense is half of them.
        "bf16": 989.4e12,  # 1,979 TFLOP/s sparse -> 989 dense
        "fp16": 989.4e12,
        "fp8": 1978.9e12,  # 3,958 sparse -> 1,979 dense
        "tf32": 494.7e12,  # 989 sparse -> 495 dense
        "fp32": 66.9e12,  # non-tensor FP32
        "fp64": 66.9e12,  # FP64 tensor core
    },
    mem_bandwidth=3.35e12,  # HBM3, 3.35 TB/s
    # 80e9 bytes is the planning figure (NVIDIA's "80GB"; the stack is 80 GiB, ~79.6 GiB usable).
    mem_capacity=80e9,
)

NVLINK4 = LinkSpec(
    name="nvlink",
    # NVLink 4: 18 links x 50 GB/s = 900 GB/s per GPU, counted both directions -> 450 each way;
    # NVSwitch gives every GPU pair in the node that rate.
    bandwidth=450e9,
    latency=1e-6,  # order of magnitude of one NCCL step inside a node; calibrate
    domain_size=8,  # 8 GPUs behind NVSwitch in one HGX/DGX H100 node
)

INFINIBAND_NDR = LinkSpec(
    name="infiniband",
    # DGX H100: 8 ConnectX-7 400 Gb/s NDR ports for the compute fabric, one per GPU
    # -> 400e9 / 8 = 50 GB/s per GPU per direction.
    bandwidth=400e9 / 8,
    latency=5e-6,  # order of magnitude of one inter-node step (NIC + switch); calibrate
    domain_size=None,
)

H100_NODE = Hardware(name="h100-sxm-8", device=H100_SXM, links=(NVLINK4, INFINIBAND_NDR))

# CPU processes over gloo: the values come from a 2-core x86-64 VM (torch 2.13 CPU, ranks as
# processes sharing the cores), measured once (2048^2 matmul, 2 threads: 84 GFLOP/s fp32,
# ~390 bf16; tensor copy ~5 GB/s; 2-rank gloo all_reduce: ~1.6 ms for 4 bytes, ~1 GB/s for
# 16 MiB). Each simulated rank gets about one core's share. Calibration will replace these.
CPU_GLOO = Hardware(
    name="cpu-gloo",
    device=DeviceSpec(
        name="cpu-core",
        peak_flops={"fp32": 40e9, "bf16": 150e9, "fp16": 20e9, "fp64": 20e9},
        mem_bandwidth=5e9,
        mem_capacity=8e9,
    ),
    links=(LinkSpec(name="gloo-loopback", bandwidth=1e9, latency=8e-4, domain_size=None),),
)

PRESETS: dict[str, Hardware] = {
    "h100-sxm-8": H100_NODE,
    "h100": H100_NODE,
    "cpu-gloo": CPU_GLOO,
}


def load_hardware(spec: "str | Path | Hardware | Mapping") -> Hardware:
    """A preset name (``"h100"``, ``"h100-sxm-8"``, ``"cpu-gloo"``), a JSON file path, a dict, or a Hardware.

    >>> load_hardware("cpu-gloo").links[0].name
    'gloo-loopback'
    """
    if isinstance(spec, Hardware):
        return spec
    if isinstance(spec, Mapping):
        return Hardware.from_dict(spec)
    if isinstance(spec, str) and spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"{str(spec)!r} is neither a hardware preset {sorted(PRESETS)} nor a JSON file")
    return Hardware.from_dict(json.loads(path.read_text()))


def save_hardware(hw: Hardware, path: "str | Path") -> Path:
    """Write ``hw`` as JSON (edit it, then ``load_hardware(path)``).

    >>> import tempfile, os
    >>> p = save_hardware(load_hardware("h100"), os.path.join(tempfile.mkdtemp(), "hw.json"))
    >>> load_hardware(p) == load_hardware("h100")
    True
    """
    path = Path(path)
    path.write_text(json.dumps(hw.to_dict(), indent=2) + "\n")
    return path
