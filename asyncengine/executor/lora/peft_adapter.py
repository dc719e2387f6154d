"""Read a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) into the
per-layer weights the forward adds on the activations (lora_step.py).

PEFT computes ``y = W x + scaling * B (A x)`` for each targeted linear, with ``scaling =
lora_alpha / r`` (``lora_alpha / sqrt(r)`` under rsLoRA; ``rank_pattern`` and ``alpha_pattern``
override r and alpha per module). The engine fuses q/k/v into one projection and gate/up into
another, so an adapter's A matrices of a fused projection are stacked ([R, in], R the sum of
the parts' ranks) and its B matrices laid block-diagonally ([out, R]), the scaling folded in:
one shrink and one expand per projection, and an untargeted part is a zero block left out of
``slices``. The base weights are never touched (a quantized base stays as stored).

Every check happens before anything is kept, so a refused adapter changes nothing. An option
under which PEFT computes something else (a LoRA variant, an initialization PEFT applies to the
base weights when it loads the adapter) is refused, never read as a plain LoRA.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from asyncengine.executor.layers.model_config import ModelConfig
from asyncengine.executor.loader.gguf_file import MAGIC as GGUF_MAGIC
from asyncengine.kernels.cpu import lora_native
from asyncengine.kernels.cpu.decode_step_lora import PreparedLora

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_WEIGHTS_FILE = "adapter_model.bin"
# the engine's fused projections and the HF modules they are made of, in output order
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
_MODULE_PARENT = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
_KEY = re.compile(
    r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>A|B)(?:\.(?P<adapter>[^.]+))?\.weight$"
)
_LAYER_MODULE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<parent>\w+)\.(?P<name>\w+)$")
MAX_ADAPTER_FILE_BYTES = 8 << 30
PEFT_DEFAULT_ALPHA = 8.0  # LoraConfig's lora_alpha when adapter_config.json leaves it out
# LoraConfig fields under which PEFT computes something other than ``W x + scaling B A x``:
# set (truthy), the adapter is refused rather than served as a plain LoRA
_VARIANT_FIELDS = {
    "alora_invocation_tokens": "activated LoRA (aLoRA) applies only after its invocation tokens",
    "arrow_config": "Arrow routes each token among several adapters",
    "use_bdlora": "block-diagonal LoRA (BD-LoRA) is not supported",
    "velora_config": "VeLoRA is not supported",
    "monteclora_config": "MonteCLoRA is not supported",
    "kasa_config": "KaSA is not supported",
    "layer_replication": "layer_replication adds layers to the base model",
    "lora_bias": "a bias on lora_B is not supported",
    "trainable_token_indices": "trained token embeddings are not supported",
}
# init_lora_weights under which PEFT rewrites the base weights when it loads the adapter
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")


class LoraLoadError(ValueError):
    """An adapter the engine refuses: unreadable, not LoRA, or not made for this base model."""


@dataclass(frozen=True, slots=True)
class ProjectionLora:
    """One fused projection's low-rank update: ``y += (x @ a.T) @ b.T``.

    ``slices``: (out_start, out_end, rank_start, rank_end) per targeted part: ``b`` is zero
    outside these blocks, which kernels may skip."""

    a: torch.Tensor  # [R, in]
    b: torch.Tensor  # [out, R], the scaling folded in
    slices: tuple[tuple[int, int, int, int], ...]
    # b transposed, [R, out]: the CPU kernel streams its rows (on a CPU ``b`` is a view of it)
    bt: torch.Tensor
    native: PreparedLora | None = None  # the CPU kernel's arguments (None: elsewhere)

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    name: str
    path: str
    rank: int  # the largest rank of its modules
    # per layer: projection name (PROJECTIONS) -> its update; a projection left out is untouched
    layers: tuple[dict[str, ProjectionLora], ...]
    target_modules: tuple[str, ...]
    # the native kernels' tables of its updates, by the cache that built them
    # (executor/lora/native_tables.py): they live and go with the adapter
    tables: dict[object, object] = field(default_factory=dict, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b.nbytes for layer in self.layers for p in layer.values())


def _pattern_value(patterns: dict[str, float], module: str, default: float) -> float:
    """PEFT's ``get_pattern_key``: the first pattern matching the end of the module's name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return float(value)
    return default


def _is_gguf(path: Path) -> bool:
    """Whether ``path`` is a file that starts as GGUF files do."""
    try:
        with path.open("rb") as f:
            return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False


def _read_config(directory: Path) -> dict[str, object]:
    path = directory / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise LoraLoadError(f"{directory} has no {CONFIG_FILE}: not a PEFT adapter") from None
    except (OSError, ValueError) as exc:
        raise LoraLoadError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise LoraLoadError(f"{path} must hold a JSON object")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise LoraLoadError(f"{path}: peft_type {kind!r} is not supported (LORA only)")
    if config.get("use_dora"):
        raise LoraLoadError(f"{path}: DoRA adapters are not supported")
    if config.get("bias", "none") != "none":
        raise LoraLoadError(f"{path}: bias {config.get('bias')!r} is not supported (none only)")
    if config.get("modules_to_save"):
        raise LoraLoadError(
            f"{path}: modules_to_save {config['modules_to_save']!r} would replace base weights; "
            "only low-rank updates are supported"
        )
    if config.get("fan_in_fan_out"):
        raise LoraLoadError(f"{path}: fan_in_fan_out adapters (Conv1D bases) do not fit a llama")
    for key, why in _VARIANT_FIELDS.items():
        if config.get(key):
            raise LoraLoadError(f"{path}: {key} is set: {why} (plain LoRA only)")
    init = str(config.get("init_lora_weights", True)).lower()
    if init.startswith(_BASE_CHANGING_INITS):
        raise LoraLoadError(
            f"{path}: init_lora_weights {config['init_lora_weights']!r} changes the base weights "
            "when PEFT loads the adapter; convert it to a plain LoRA first (PEFT's save_pretrained("
            "..., path_initial_model_for_weight_conversion=...), or init_lora_weights true with the "
            "base model it was trained on)"
        )
    return config


def _module_part(module: str, config: ModelConfig) -> tuple[int, str]:
    """(layer index, HF module name) of a targeted module, or LoraLoadError."""
    match = _LAYER_MODULE.match(module)
    if match is None or match["name"] not in _MODULE_PARENT:
        short = module.rsplit(".", 1)[-1]
        raise LoraLoadError(
            f"target module {short!r} ({module}) is not one the engine adapts: LoRA applies to "
            f"{', '.join(_MODULE_PARENT)} (an embedding or LM head adapter would also have to "
            "match the base vocabulary)"
        )
    if match["parent"] != _MODULE_PARENT[match["name"]]:
        raise LoraLoadError(f"target module {module} does not exist in a llama-family model")
    layer = int(match["layer"])
    if layer >= config.num_layers:
        raise LoraLoadError(
            f"the adapter targets layer {layer}; the base model has {config.num_layers} layers"
        )
    return layer, match["name"]


def _part_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each HF module of the base model."""
    h, q, kv, inter = (
        config.hidden_size,
        config.q_size,
        config.kv_size,
        config.intermediate_size,
    )
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (inter, h),
        "up_proj": (inter, h),
        "down_proj": (h, inter),
    }


def load_peft_adapter(
    name: str,
    path: str | Path,
    config: ModelConfig,
    max_rank: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> LoraAdapter:
    """The adapter at ``path`` for a base model of ``config``; LoraLoadError says why not."""
    directory = Path(path)
    if not directory.is_dir():
        if _is_gguf(directory):
            raise LoraLoadError(
                f"LoRA adapter path {str(path)!r} is a GGUF file: llama.cpp's GGUF LoRA files "
                f"are not served; pass a PEFT adapter directory ({CONFIG_FILE} + {WEIGHTS_FILE})"
            )
        raise LoraLoadError(f"LoRA adapter path {str(path)!r} is not a directory")
    adapter_config = _read_config(directory)
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        # what save_pretrained(safe_serialization=False) writes
        if (directory / PICKLED_WEIGHTS_FILE).is_file():
            raise LoraLoadError(
                f"{directory} has no {WEIGHTS_FILE}, only {PICKLED_WEIGHTS_FILE}, a pickle, which "
                "the engine does not read: save the adapter with safe_serialization=True (PEFT's "
                "default) or convert the file to safetensors"
            )
        raise LoraLoadError(f"{directory} has no {WEIGHTS_FILE}")
    if weights_path.stat().st_size > MAX_ADAPTER_FILE_BYTES:
        raise LoraLoadError(f"{weights_path} is larger than {MAX_ADAPTER_FILE_BYTES} bytes")
    use_rslora = bool(adapter_config.get("use_rslora", False))
    alpha = float(adapter_config.get("lora_alpha", PEFT_DEFAULT_ALPHA))  # type: ignore[arg-type]
    alpha_pattern = dict(adapter_config.get("alpha_pattern") or {})  # type: ignore[call-overload]
    rank_pattern = dict(adapter_config.get("rank_pattern") or {})  # type: ignore[call-overload]
    configured_r = adapter_config.get("r")
    shapes = _part_shapes(config)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            for key in f.keys():
                match = _KEY.match(key)
                if match is None:
                    raise LoraLoadError(
                        f"{weights_path}: tensor {key!r} is not a LoRA A/B weight of a linear "
                        "(embedding adapters, biases and saved modules are not supported)"
                    )
                pairs.setdefault(match["module"], {})[match["which"]] = f.get_tensor(key)
    except LoraLoadError:
        raise
    except Exception as exc:  # safetensors raises its own error types for a bad file
        raise LoraLoadError(f"{weights_path} is not a readable safetensors file: {exc}") from None
    if not pairs:
        raise LoraLoadError(f"{weights_path} holds no LoRA weights")
    # layer -> HF module -> (A, B scaled)
    parts: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    ranks: list[int] = []
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoraLoadError(f"{weights_path}: module {module} lacks its lora_A or lora_B")
        layer, part = _module_part(module, config)
        a, b = ab["A"], ab["B"]
        out, inp = shapes[part]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoraLoadError(f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}")
        rank = int(a.shape[0])
        if isinstance(configured_r, int | float):  # PEFT builds the module at this rank only
            said = int(_pattern_value(rank_pattern, module, float(configured_r)))
            if said != rank:
                raise LoraLoadError(
                    f"{module}: its weights have rank {rank} but adapter_config.json says "
                    f"{said} (r / rank_pattern)"
                )
        if rank > max_rank:
            raise LoraLoadError(
                f"{module} has rank {rank}, over the limit of {max_rank} (max_lora_rank)"
            )
        if a.shape[1] != inp or b.shape[0] != out:
            raise LoraLoadError(
                f"{module}: the adapter's shape is {b.shape[0]} x {a.shape[1]} (out x in), the "
                f"base model's is {out} x {inp}: "
                "made for another base model"
            )
        module_alpha = _pattern_value(alpha_pattern, module, alpha)
        scaling = module_alpha / (math.sqrt(rank) if use_rslora else rank)
        scaled_b = b.to(torch.float32) * scaling
        parts.setdefault(layer, {})[part] = (a.to(torch.float32), scaled_b)
        ranks.append(rank)
    layers: list[dict[str, ProjectionLora]] = []
    for i in range(config.num_layers):
        mine = parts.get(i, {})
        fused: dict[str, ProjectionLora] = {}
        for projection, members in PROJECTIONS.items():
            present = [m for m in members if m in mine]
            if present:
                fused[projection] = _fuse(members, mine, shapes, dtype, device)
        layers.append(fused)
    targets = tuple(sorted({part for layer in parts.values() for part in layer}))
    return LoraAdapter(name, str(path), max(ranks), tuple(layers), targets)


def _fuse(
    members: tuple[str, ...],
    mine: dict[str, tuple[torch.Tensor, torch.Tensor]],
    shapes: dict[str, tuple[int, int]],
    dtype: torch.dtype,
    device: torch.device | str,
) -> ProjectionLora:
    """Stack the parts' A matrices and lay their B matrices block-diagonally."""
    total_rank = sum(int(mine[m][0].shape[0]) for m in members if m in mine)
    out_total = sum(shapes[m][0] for m in members)
    inp = shapes[members[0]][1]
    a = torch.zeros(total_rank, inp, dtype=torch.float32)
    b = torch.zeros(out_total, total_rank, dtype=torch.float32)
    slices: list[tuple[int, int, int, int]] = []
    out_at = rank_at = 0
    for m in members:
        out = shapes[m][0]
        if m in mine:
            part_a, part_b = mine[m]
            r = int(part_a.shape[0])
            a[rank_at : rank_at + r] = part_a
            b[out_at : out_at + out, rank_at : rank_at + r] = part_b
            slices.append((out_at, out_at + out, rank_at, rank_at + r))
            rank_at += r
        out_at += out
    a = a.to(device=device, dtype=dtype).contiguous()
    if torch.device(device).type == "cpu":
        bt = b.t().to(dtype=dtype).contiguous()
        native = lora_native.prepare(a, bt, lora_native.slices_array(tuple(slices)))
        return ProjectionLora(a, bt.t(), tuple(slices), bt, native)
    b = b.to(device=device, dtype=dtype).contiguous()
    return ProjectionLora(a, b, tuple(slices), b.t())
