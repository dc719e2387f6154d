"""Accuracy of the quantized weight paths on the embedded model, against the same weights
dequantized to float32 (the reference: the GGUF's Q4_1 / Q8_0 blocks expand to float32 exactly).

    python scripts/quant_accuracy.py [--json out.json]
    python scripts/quant_accuracy.py --gguf ~/.cache/asyncengine/models/qwen2.5-1.5b/qwen2.5-1.5b-Q4_K_M.gguf --variants gguf

``--gguf`` measures another GGUF file the same way (a model of a real shape from
scripts/make_real_models.py, in any format the kernels take: the K formats expand to float32
exactly as well); its float32 reference takes 4 bytes a parameter.

Variants (all float32 activations, the CPU):
- ``gguf``: the file's tensors kept as stored (Q4_1 projections, Q8_0 embedding / LM head) on
  the native kernels: the only difference from the reference is the int8 quantization of the
  activations (blocks of 32);
- ``q8_0``: every 2-D weight of the reference re-quantized to Q8_0 (gguf's quantizer);
- ``int8``: every 2-D weight quantized per output row (quantization = "int8");
- ``gguf_kv_f16``: ``gguf`` over a float16 K/V pool (``kv_cache_dtype = "float16"``, what
  ``auto`` picks for it on an F16C CPU): the activations' int8 blocks and K/V rounded to half;
- ``gguf_i8``: ``gguf`` on the int8 product (kernels/cpu/cpu_quant_i8gemm.c: the activations in
  int8 per 256 values against the K formats, per 32 against Q8_0 / Q4_0 / Q4_1) wherever a call
  reaches the projections and the CPU runs it for them (else the dense product of their float32
  weights); the fused decode step of the greedy tokens keeps the quantized kernel;
- ``gguf_deterministic``: ``gguf`` in deterministic mode (``deterministic = true``: the int8
  product at every row count for the K formats and Q8_0 where the CPU runs it, else the
  quantized kernel; the embedded model's Q4_1 projections keep the quantized kernel).

Every quantized projection but ``gguf_i8``'s runs the quantized kernel here, at every batch size
(the engine switches to the dense product from 32 rows). For each: the largest and mean absolute logit
difference over every position of a fixed text
(teacher-forced), the share of positions whose argmax agrees, the text's perplexity beside the
reference's, and the greedy continuations of a few prompts compared token by token.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncengine.cache.page_table import PageTable
from asyncengine.common.plan import BatchPlan, Segment
from asyncengine.executor.kv_pool import KVPool
from asyncengine.executor.layers.linear import QuantizedLinear
from asyncengine.executor.layers.model_config import ModelConfig
from asyncengine.executor.loader import read_gguf
from asyncengine.executor.loader.default_model import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    gguf_file,
    metadata_dir,
)
from asyncengine.executor.loader.gguf_loader import Weight
from asyncengine.executor.loader.quantized import quantize_int8
from asyncengine.executor.runner import ModelRunner
from asyncengine.kernels.quant_formats import GGUF_FORMATS, Q8_0, QuantizedTensor
from asyncengine.text.tokenizer import Tokenizer

# A fixed text the model was not tuned on (written for this check): ~630 tokens of prose, a recipe,
# code and facts: long enough that a logit crossing an int8 rounding step moves the figures by
# little (a 1e-6 change of the norms moves ``gguf``'s perplexity by up to 0.8% here, 2% over 110 tokens)
TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He carried a small "
    "can of oil, a cloth and a notebook in which he wrote the weather, the ships he had seen and "
    "the state of the lamp. In winter the wind came from the north and rattled the windows of "
    "the lantern room, and he would stay until the beam turned steadily over the dark water. "
    "Over forty years he filled eleven notebooks. When the light was automated, the notebooks "
    "went to the town museum, where children still read them aloud on rainy afternoons.\n\n"
    "Bread needs only four things: flour, water, salt and time. Mix the flour and water until no "
    "dry patches remain, then leave the dough to rest for half an hour so that the flour can "
    "absorb the water. Add the salt and a little yeast, and fold the dough over itself every "
    "thirty minutes for the next two hours. Each fold stretches the gluten and traps more air. "
    "Once the dough has doubled in size, shape it into a round loaf, cover it with a towel and "
    "let it rise again in a cool place overnight. In the morning, bake it in a very hot oven "
    "for forty minutes, until the crust is deep brown and the loaf sounds hollow when tapped "
    "underneath. Let it cool completely before cutting, or the crumb will be gummy.\n\n"
    "A library is more than a room full of books. In the small town where I grew up, the "
    "library was the only warm place open on Sunday afternoons, and it was where old men read "
    "the newspapers, students prepared for their exams and families borrowed films for the "
    "weekend. The librarian knew every regular visitor by name and remembered which authors "
    "they liked. When the council proposed closing it to save money, hundreds of people came "
    "to the meeting, and the plan was quietly dropped.\n\n"
    "To find the largest number in a list, start by assuming that the first element is the "
    "largest. Then walk through the rest of the list, and whenever you meet an element larger "
    "than the current answer, replace the answer with it. When the walk ends, the answer is the "
    "largest element. In Python this is a short loop:\n\n"
    "def largest(values):\n"
    "    best = values[0]\n"
    "    for value in values[1:]:\n"
    "        if value > best:\n"
    "            best = value\n"
    "    return best\n\n"
    "The loop looks at each element once, so its running time grows linearly with the length of "
    "the list. Python's built-in max function does the same work and is usually faster.\n\n"
    "The migration of the arctic tern is the longest of any animal. Each year these small "
    "seabirds fly from their breeding grounds in the Arctic to the coast of Antarctica and back, "
    "a round trip of more than seventy thousand kilometres. Because they follow the summer from "
    "one pole to the other, they see more daylight than any other creature on Earth. A tern can "
    "live for thirty years, so over its lifetime it may fly a distance equal to three trips to "
    "the Moon and back. Scientists learned these facts by fitting the birds with tiny "
    "geolocators that weigh less than a paper clip."
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Three things to pack for a hike are",
    "Water boils at",
    "Once upon a time, in a small village,",
    "The main difference between a virus and a bacterium is",
    "SELECT name, age FROM users WHERE",
    "My favourite season of the year is",
]
GREEDY_TOKENS = 24
PAGE_SIZE = 16
PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")


@dataclass(slots=True)
class VariantResult:
    name: str
    max_abs_logit_diff: float
    mean_abs_logit_diff: float
    argmax_agreement: float
    perplexity: float
    reference_perplexity: float
    perplexity_ratio: float
    greedy_tokens_agreeing: int  # tokens equal to the reference before the first difference
    greedy_tokens_total: int


class Model:
    """A runner over a fresh pool, big enough for one sequence of the text's length."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, Weight],
        max_len: int,
        kv_dtype: torch.dtype = torch.float32,
        i8: bool = False,
        deterministic: bool = False,
    ) -> None:
        pages = -(-max_len // PAGE_SIZE)
        self.config = config
        self.max_len = max_len
        pool = KVPool.for_model(config, pages, PAGE_SIZE, kv_dtype)
        table = PageTable.contiguous(1, pages)
        self.runner = ModelRunner(
            config, weights, pool, table, torch.float32, deterministic=deterministic
        )
        # the quantized kernel at every batch size: a prefill of the text would otherwise take
        # the dense product of the same (dequantized) weights and hide the kernel's error
        model = self.runner.model
        linears = [model.lm_head, *(getattr(b, n) for b in model.layers for n in PROJECTIONS)]
        for linear in linears:
            if isinstance(linear, QuantizedLinear):
                linear.dense_from_rows = 1 if i8 else None

    def all_logits(self, tokens: list[int]) -> torch.Tensor:
        """[len(tokens), vocab] float32 logits of a whole sequence, one prefill."""
        plan = BatchPlan(step=1, extends=[Segment("t", 0, tokens, 0, True)])
        with torch.inference_mode():
            batch = self.runner.prepare(plan)
            batch = replace(batch, sample_indices=torch.arange(len(tokens)))
            metadata = self.runner.backend.build_metadata(batch)
            model = self.runner.model
            hidden = model.forward(
                batch, self.runner.backend, metadata, self.runner.k_caches, self.runner.v_caches
            )
            return model.compute_logits(hidden)

    def greedy(self, prompt: list[int], count: int) -> list[int]:
        tokens = list(prompt)
        out: list[int] = []
        with torch.inference_mode():
            plan = BatchPlan(step=1, extends=[Segment("g", 0, tokens, 0, True)])
            for step in range(count):
                token = int(self.runner.forward_logits(plan)[0].argmax())
                out.append(token)
                plan = BatchPlan(
                    step=step + 2, decodes=[Segment("g", 0, [token], len(tokens), True)]
                )
                tokens.append(token)
        return out


def perplexity(logits: torch.Tensor, tokens: list[int]) -> float:
    logprobs = torch.log_softmax(logits[:-1].double(), dim=-1)
    targets = torch.tensor(tokens[1:])
    nll = -logprobs.gather(1, targets.unsqueeze(1)).mean()
    return math.exp(float(nll))


def requantize_q8_0(weights: dict[str, Weight]) -> dict[str, Weight]:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    out: dict[str, Weight] = {}
    for name, weight in weights.items():
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[1] % 32 == 0:
            raw = quantize(weight.float().numpy(), GGMLQuantizationType.Q8_0)
            data = torch.from_numpy(raw.copy()).reshape(weight.shape[0], -1)
            out[name] = QuantizedTensor(Q8_0, data, int(weight.shape[1]))
        else:
            out[name] = weight
    return out


def evaluate(variants: list[str] | None = None, gguf: Path | None = None) -> list[VariantResult]:
    """``gguf``: the file to measure (default: the embedded model's)."""
    model = KNOWN_MODELS[DEFAULT_MODEL]
    found = gguf_file(gguf) if gguf is not None else (model.gguf_path(), model.name)
    if found is None:
        raise SystemExit(f"{gguf} is not a .gguf file")
    gguf_path, cache_name = found
    meta = metadata_dir(gguf_path, cache_name)
    tokenizer = Tokenizer(meta)
    config = ModelConfig.from_hf_dict(json.loads((meta / "config.json").read_text()))
    text_tokens = tokenizer.encode(TEXT)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    max_len = max(len(text_tokens), *(len(p) + GREEDY_TOKENS for p in prompts)) + 1

    variants = variants or ["gguf", "q8_0", "int8", "gguf_kv_f16"]

    def float32_weights() -> dict[str, Weight]:
        return read_gguf(gguf_path, torch.float32).weights

    # the float32 weights are kept only for the variants quantized from them: a real-shape
    # model's reference alone is 4 bytes a parameter, and the runner copies it once more
    kept = float32_weights() if {"q8_0", "int8"} & set(variants) else None
    builders = {
        "gguf": lambda: read_gguf(gguf_path, torch.float32, frozenset(GGUF_FORMATS)).weights,
        "q8_0": lambda: requantize_q8_0(kept or float32_weights()),
        "int8": lambda: quantize_int8(kept or float32_weights()),
        "gguf_kv_f16": lambda: read_gguf(gguf_path, torch.float32, frozenset(GGUF_FORMATS)).weights,
        "gguf_i8": lambda: read_gguf(gguf_path, torch.float32, frozenset(GGUF_FORMATS)).weights,
        "gguf_deterministic": lambda: (
            read_gguf(gguf_path, torch.float32, frozenset(GGUF_FORMATS)).weights
        ),
    }
    kv_dtypes = {"gguf_kv_f16": torch.float16}
    reference = Model(config, kept or float32_weights(), max_len)
    ref_logits = reference.all_logits(text_tokens)
    ref_ppl = perplexity(ref_logits, text_tokens)
    ref_greedy = [reference.greedy(p, GREEDY_TOKENS) for p in prompts]
    del reference  # before a candidate is built
    gc.collect()
    results = []
    for name in variants:
        candidate = Model(
            config,
            builders[name](),
            max_len,
            kv_dtypes.get(name, torch.float32),
            i8=name == "gguf_i8",
            deterministic=name == "gguf_deterministic",
        )
        logits = candidate.all_logits(text_tokens)
        diff = (logits - ref_logits).abs()
        ppl = perplexity(logits, text_tokens)
        agreeing = 0
        for prompt, want in zip(prompts, ref_greedy, strict=True):
            got = candidate.greedy(prompt, GREEDY_TOKENS)
            agreeing += next(
                (i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(want)
            )
        results.append(
            VariantResult(
                name=name,
                max_abs_logit_diff=float(diff.max()),
                mean_abs_logit_diff=float(diff.mean()),
                argmax_agreement=float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()),
                perplexity=ppl,
                reference_perplexity=ref_ppl,
                perplexity_ratio=ppl / ref_ppl,
                greedy_tokens_agreeing=agreeing,
                greedy_tokens_total=GREEDY_TOKENS * len(prompts),
            )
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="gguf,q8_0,int8,gguf_kv_f16")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--gguf", type=Path, default=None, help="default: the embedded model")
    args = parser.parse_args()
    results = evaluate(args.variants.split(","), args.gguf)
    print(
        "| weights | max abs logit diff | mean abs diff | argmax agrees | perplexity (fp32) | greedy tokens agreeing |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r.name} | {r.max_abs_logit_diff:.3f} | {r.mean_abs_logit_diff:.4f} | "
            f"{r.argmax_agreement:.1%} | {r.perplexity:.3f} ({r.reference_perplexity:.3f}, "
            f"{r.perplexity_ratio - 1:+.2%}) | {r.greedy_tokens_agreeing}/{r.greedy_tokens_total} |"
        )
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")


if __name__ == "__main__":
    main()
