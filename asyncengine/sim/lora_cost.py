"""LoRA in a simulated run: the adapters' compute in each step, and their read back into memory.

Each row (token) of a request under an adapter of rank r passes, in every layer and target
module (``in`` -> ``out`` features), through the adapter's shrink (``2 * in * r`` FLOPs) and
expand (``2 * r * out``); every adapter in a step has its weights read once (the same bytes as
its file) and a segment of kernels launched. So a step's LoRA time is

    per_flop * flops + per_weight_byte * (weight bytes of the step's adapters)
                     + per_adapter * (distinct adapters in the step)

As in the engine (api/held_groups.py, executor/lora/registry.py), a request whose adapter is not
in memory is held out of the queue from its arrival while the adapter is read back, ``per_load +
per_load_byte * bytes`` later, once for all the requests that wait for it; the steps go on
meanwhile and pay nothing for it. At most ``max_cpu_loras`` adapters stay in memory besides
those of requests in flight (held, waiting or running), the least recently used dropped first
at each step (and read again when they come back). The coefficients are fitted by
``scripts/fit_lora_cost.py``; the shipped ones are ``default_lora_cost_model.json``.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from asyncengine.common.config import ConfigError
from asyncengine.common.plan import BatchPlan
from asyncengine.common.request import Request

DEFAULT_LORA_COST_MODEL_PATH = Path(__file__).with_name("default_lora_cost_model.json")

# The embedded default model's (SmolLM2-135M) target modules: name, in features, out features
SMOLLM2_MODULES: tuple[tuple[str, int, int], ...] = (
    ("q_proj", 576, 576),
    ("k_proj", 576, 192),
    ("v_proj", 576, 192),
    ("o_proj", 576, 576),
    ("gate_proj", 576, 1536),
    ("up_proj", 576, 1536),
    ("down_proj", 1536, 576),
)


@dataclass(frozen=True, slots=True)
class LoraShape:
    """Where adapters attach: the base's layers and target modules, and bytes per weight."""

    num_layers: int = 30
    modules: tuple[tuple[str, int, int], ...] = SMOLLM2_MODULES
    bytes_per_weight: int = 2  # bfloat16 adapters

    def __post_init__(self) -> None:
        if self.num_layers < 1 or not self.modules or self.bytes_per_weight < 1:
            raise ValueError("a LoRA shape needs layers, target modules and bytes per weight")

    def flops_per_row(self, rank: int) -> int:
        """Shrink and expand FLOPs of one row through every layer's target modules."""
        return self.num_layers * sum(2 * rank * (n_in + n_out) for _, n_in, n_out in self.modules)

    def adapter_bytes(self, rank: int) -> int:
        """Bytes of an adapter's A and B matrices (its file, less the header)."""
        return self.num_layers * sum(
            rank * (n_in + n_out) * self.bytes_per_weight for _, n_in, n_out in self.modules
        )


@dataclass(frozen=True, slots=True)
class LoraCostModel:
    """Coefficients in seconds. ``description`` says where they were measured."""

    per_flop: float = 5.0e-12
    per_weight_byte: float = 1.0e-10
    per_adapter: float = 2.0e-4
    per_load: float = 2.0e-3
    per_load_byte: float = 1.0e-9
    description: str = "built-in guess"

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name != "description" and not value >= 0:
                raise ValueError(f"LoRA cost model: {item.name} must be >= 0, got {value!r}")

    def compute_seconds(self, flops: int, weight_bytes: int, adapters: int) -> float:
        return (
            self.per_flop * flops
            + self.per_weight_byte * weight_bytes
            + self.per_adapter * adapters
        )

    def load_seconds(self, nbytes: int) -> float:
        return self.per_load + self.per_load_byte * nbytes

    @classmethod
    def fit(
        cls,
        compute: Sequence[tuple[int, int, int, float]],
        loads: Sequence[tuple[int, float]],
        description: str = "",
    ) -> LoraCostModel:
        """Fitted to measured steps, ``(flops, weight bytes, adapters, seconds)``, and loads,
        ``(bytes, seconds)``: non-negative least squares on relative error (a term that would
        get a negative weight is dropped and the rest refit)."""
        flop, weight, adapter = _nnls_relative(
            [row[:3] for row in compute], [r[3] for r in compute]
        )
        per_byte, per_load = _nnls_relative([(b, 1) for b, _ in loads], [s for _, s in loads])
        return cls(flop, weight, adapter, per_load, per_byte, description)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> LoraCostModel:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"{path}: unknown LoRA cost model keys {sorted(unknown)}")
        return cls(**data)

    @classmethod
    def default(cls) -> LoraCostModel:
        """The model fitted on the development machine when shipped, else the built-in guess."""
        if DEFAULT_LORA_COST_MODEL_PATH.exists():
            return cls.load(DEFAULT_LORA_COST_MODEL_PATH)
        return cls()


def _nnls_relative(rows: Sequence[Sequence[float]], seconds: Sequence[float]) -> list[float]:
    """Non-negative coefficients c minimising the relative errors of ``rows @ c`` against
    ``seconds``."""
    if not rows or len(rows) != len(seconds):
        raise ValueError("need one measured time per row, and at least one row")
    times = np.asarray(seconds, dtype=float)
    if not np.all(times > 0):
        raise ValueError("measured times must be positive")
    design = np.asarray(rows, dtype=float) / times[:, None]
    target = np.ones_like(times)
    active = list(range(design.shape[1]))
    coefficients = np.zeros(design.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(design[:, active], target, rcond=None)
        if np.all(solution >= 0):
            coefficients[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    return [float(c) for c in coefficients]


@dataclass(frozen=True, slots=True)
class SimLoras:
    """The simulator's adapters: each one's rank (``ranks``, else ``default_rank``), how many
    stay loaded (``max_cpu_loras``), the cost model and the base's shape."""

    ranks: Mapping[str, int] = field(default_factory=dict)
    default_rank: int = 16
    max_cpu_loras: int = 8
    cost: LoraCostModel = field(default_factory=LoraCostModel.default)
    shape: LoraShape = field(default_factory=LoraShape)

    def __post_init__(self) -> None:
        if self.default_rank < 1 or any(rank < 1 for rank in self.ranks.values()):
            raise ValueError("LoRA ranks must be >= 1")
        if self.max_cpu_loras < 1:
            raise ValueError("max_cpu_loras must be >= 1")

    def rank(self, adapter: str) -> int:
        return self.ranks.get(adapter, self.default_rank)

    def check_fits(self, max_loras: int) -> None:
        """ConfigError unless a step's ``max_loras`` adapters fit in memory together."""
        if self.max_cpu_loras < max_loras:
            raise ConfigError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({max_loras}): "
                "a step's adapters are all loaded"
            )

    @classmethod
    def for_config(cls, max_cpu_loras: int | None) -> SimLoras:
        """The engine's ``max_cpu_loras`` (None: every adapter stays loaded, so none is read
        from disk twice)."""
        return cls(max_cpu_loras=max_cpu_loras if max_cpu_loras is not None else 1 << 30)


@dataclass(slots=True)
class ReadBack:
    """An adapter's weights being read back into memory, and the requests held for them."""

    ends: float  # when the read is done, in simulated seconds
    held: list[Request] = field(default_factory=list)


class LoraCharges:
    """What a simulated run's adapters cost and which are in memory. ``adapters`` maps each
    request id to its adapter (requests without one cost nothing here); ``in_flight`` holds the
    ids of the requests queued or running (the scheduler's), whose adapters are never dropped.

    ``loaded``: the adapters read at start-up, in order (the config's ``loras``, which the
    engine loads before its first request): the last ``max_cpu_loras`` of them start in memory.

    A driver hands each arrival to ``hold`` and queues it unless held, and queues what
    ``read_back`` gives once the simulated clock reaches ``next_read_end``."""

    def __init__(
        self,
        loras: SimLoras,
        adapters: Mapping[str, str],
        in_flight: Collection[str] = (),
        loaded: Sequence[str] = (),
    ) -> None:
        self.loras = loras
        self.adapters = adapters
        self.in_flight = in_flight
        kept = list(loaded)[-loras.max_cpu_loras :] if loaded else []
        # least recently used first
        self.resident: OrderedDict[str, None] = OrderedDict.fromkeys(kept)
        self.reading: dict[str, ReadBack] = {}  # adapter -> its read under way
        self.holding = 0  # requests held for a read
        self.loads = 0
        self.load_seconds = 0.0
        self.compute_seconds = 0.0

    def hold(self, req: Request) -> bool:
        """Whether ``req`` waits out of the queue for its adapter's read back: started at its
        arrival, or the one already under way. False: no adapter, or it is in memory."""
        lora = req.lora
        if lora is None:
            return False
        if lora in self.resident:
            self.resident.move_to_end(lora)
            return False
        read = self.reading.get(lora)
        if read is None:
            seconds = self.loras.cost.load_seconds(
                self.loras.shape.adapter_bytes(self.loras.rank(lora))
            )
            read = self.reading[lora] = ReadBack(req.arrival_time + seconds)
            self.loads += 1
            self.load_seconds += seconds
        read.held.append(req)
        self.holding += 1
        return True

    def next_read_end(self) -> float | None:
        """When the first read under way is done (None: none is)."""
        return min((read.ends for read in self.reading.values()), default=None)

    def read_back(self, until: float) -> list[Request]:
        """The held requests whose adapter's read has ended by ``until``, in the order the
        reads ended, to be queued; their adapters are in memory from here."""
        if not self.reading:
            return []
        done = sorted(
            (read.ends, lora) for lora, read in self.reading.items() if read.ends <= until
        )
        released: list[Request] = []
        for _, lora in done:
            released += self.reading.pop(lora).held
            self.resident[lora] = None
        self.holding -= len(released)
        return released

    def step_seconds(self, plan: BatchPlan) -> float:
        """The LoRA compute of ``plan``'s adapters' rows (an adapter not in memory, which a
        driver that holds nothing leaves there, is read by the step, as in the engine)."""
        adapters = self.adapters
        rows: dict[str, int] = {}
        for seg in plan.extends:
            lora = adapters.get(seg.rid)
            if lora is not None:
                rows[lora] = rows.get(lora, 0) + len(seg.input_ids)
        for seg in plan.decodes:
            lora = adapters.get(seg.rid)
            if lora is not None:
                rows[lora] = rows.get(lora, 0) + 1 + seg.guesses
        loras, shape, cost = self.loras, self.loras.shape, self.loras.cost
        flops = weight_bytes = 0
        load = 0.0
        resident = self.resident
        for lora, count in rows.items():
            rank = loras.rank(lora)
            flops += count * shape.flops_per_row(rank)
            nbytes = shape.adapter_bytes(rank)
            weight_bytes += nbytes
            if lora in resident:
                resident.move_to_end(lora)
            else:
                resident[lora] = None
                self.loads += 1
                load += cost.load_seconds(nbytes)
        self._drop_past_cap(rows)
        if not rows:
            return 0.0
        compute = cost.compute_seconds(flops, weight_bytes, len(rows))
        self.compute_seconds += compute
        self.load_seconds += load
        return compute + load

    def _drop_past_cap(self, step: Collection[str]) -> None:
        """Drop the least recently used adapters past ``max_cpu_loras``, never one of the step
        or of a request in flight."""
        resident = self.resident
        excess = len(resident) - self.loras.max_cpu_loras
        if excess <= 0:
            return
        adapters = self.adapters
        keep = {adapters.get(rid) for rid in self.in_flight}
        for lora in list(resident):
            if excess == 0:
                return
            if lora not in step and lora not in keep:
                del resident[lora]
                excess -= 1

    def stats(self) -> dict[str, float]:
        return {
            "lora_loads": self.loads,
            "lora_load_seconds": self.load_seconds,
            "lora_compute_seconds": self.compute_seconds,
        }
