"""LoRA adapters through the engine: greedy outputs equal HF + PEFT's in one batch mixing three
adapters and the base, prefix cache on and off; KV computed under one adapter is never reused by
another or the base; hot load and unload; adapters dropped from memory and read back."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from asyncengine import AdapterUnavailableError
from asyncengine.api.engine import AsyncEngine
from asyncengine.common.config import EngineConfig
from asyncengine.common.errors import UnknownAdapterError
from asyncengine.common.outputs import GenerateOutput
from asyncengine.common.sampling_params import InvalidRequestError, SamplingParams
from asyncengine.sim.lora_cost import LoraCharges, SimLoras
from tests.executor.lora_support import PeftOracle, write_adapters
from tests.server_support import engine_config, tiny_model_dir

NEW_TOKENS = 8
# long enough to fill whole pages (16 tokens), so that the prefix cache holds them
PROMPT = [1, *range(300, 340)]
OTHER = [1, *range(900, 933)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_adapters(model_dir, tmp_path_factory.mktemp("engine_loras"))


@pytest.fixture(scope="module")
def oracle(model_dir: Path, adapters: dict[str, Path]) -> PeftOracle:
    return PeftOracle(model_dir, adapters)


def greedy(lora: str | None) -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, lora=lora)


MIX: list[tuple[str | None, list[int]]] = [
    (None, PROMPT),
    ("r4", PROMPT),
    ("r8", PROMPT),
    ("r16", OTHER),
    ("r8", OTHER),
    (None, OTHER),
]


@pytest.mark.asyncio
@pytest.mark.parametrize("prefix_cache", [True, False], ids=["cache", "no-cache"])
async def test_mixed_batch_equals_peft_and_no_adapter_reuses_anothers_kv(
    model_dir: Path, adapters: dict[str, Path], oracle: PeftOracle, prefix_cache: bool
) -> None:
    loras = {name: str(path) for name, path in adapters.items()}
    config = engine_config(model_dir, loras=loras, enable_prefix_cache=prefix_cache)
    want = [oracle.greedy(lora, prompt, NEW_TOKENS) for lora, prompt in MIX]
    assert len({tuple(w) for w in want[:3]}) == 3  # the adapters change what the model writes
    async with AsyncEngine(config) as engine:
        together = await asyncio.gather(*(engine.generate(p, greedy(a)) for a, p in MIX))
        assert [o.token_ids for o in together] == want
        # one at a time: each prompt's pages are cached by now under the adapter that made them
        for (lora, prompt), expected in zip(MIX, want, strict=True):
            again = await engine.generate(prompt, greedy(lora))
            assert again.token_ids == expected
            assert (again.usage.cached_tokens > 0) == prefix_cache
        await engine.reset_prefix_cache()
        first = await engine.generate(PROMPT, greedy(None))
        # the base just cached these pages: no adapter (nor the base under a salt) takes them
        for lora in ("r4", "r8", "r16"):
            out = await engine.generate(PROMPT, greedy(lora))
            assert out.usage.cached_tokens == 0, lora
        base_again = await engine.generate(PROMPT, greedy(None))
    assert first.token_ids == base_again.token_ids == want[0]
    assert (base_again.usage.cached_tokens > 0) == prefix_cache


@pytest.mark.asyncio
async def test_a_config_files_relative_model_and_adapter_load_from_its_folder(
    model_dir: Path,
    adapters: dict[str, Path],
    oracle: PeftOracle,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A TOML beside its model and adapter names them by relative paths, and the engine loads
    them when started from another folder."""
    folder = tmp_path / "experiment"
    shutil.copytree(model_dir, folder / "m")
    shutil.copytree(adapters["r4"], folder / "adapters" / "r4")
    path = folder / "run.toml"
    path.write_text(
        'model = "./m"\ndtype = "float32"\ndevice = "cpu"\nlog_interval = 0.0\n'
        'page_size = 16\nkv_cache_tokens = 4096\n[loras]\nr4 = "adapters/r4"\n'
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    async with AsyncEngine(EngineConfig.from_toml(path)) as engine:
        base = await engine.generate(PROMPT, greedy(None))
        tuned = await engine.generate(PROMPT, greedy("r4"))
    assert base.token_ids == oracle.greedy(None, PROMPT, NEW_TOKENS)
    assert tuned.token_ids == oracle.greedy("r4", PROMPT, NEW_TOKENS)


@pytest.mark.asyncio
async def test_load_unload_and_refusals(
    model_dir: Path, adapters: dict[str, Path], oracle: PeftOracle, tmp_path: Path
) -> None:
    config = engine_config(model_dir, max_lora_rank=8)
    async with AsyncEngine(config) as engine:
        with pytest.raises(UnknownAdapterError):
            await engine.generate(PROMPT, greedy("r4"))
        await engine.load_lora("r4", str(adapters["r4"]))
        assert engine.lora_adapters == {"r4": str(adapters["r4"])}
        out = await engine.generate(PROMPT, greedy("r4"))
        assert out.token_ids == oracle.greedy("r4", PROMPT, NEW_TOKENS)
        # refused loads change nothing
        with pytest.raises(InvalidRequestError, match="rank 16, over the limit of 8"):
            await engine.load_lora("r16", str(adapters["r16"]))
        with pytest.raises(InvalidRequestError, match="not a PEFT adapter"):
            await engine.load_lora("empty", str(tmp_path))
        for name in ("a/b", "two\nlines", "x" * 257):  # no request could name it as loaded
            with pytest.raises(InvalidRequestError, match="name is 1 to 256 printable characters"):
                await engine.load_lora(name, str(adapters["r8"]))
        bad = tmp_path / "bad"
        shutil.copytree(adapters["r4"], bad)
        cfg = json.loads((bad / "adapter_config.json").read_text())
        cfg["peft_type"] = "PREFIX_TUNING"
        (bad / "adapter_config.json").write_text(json.dumps(cfg))
        with pytest.raises(InvalidRequestError, match="PREFIX_TUNING"):
            await engine.load_lora("r4", str(bad))
        assert engine.lora_adapters == {"r4": str(adapters["r4"])}
        assert (await engine.generate(PROMPT, greedy("r4"))).token_ids == out.token_ids
        # unloaded while a request runs under it: that request finishes under the adapter
        running = asyncio.create_task(
            engine.generate(OTHER, SamplingParams(max_new_tokens=40, temperature=0.0,
                                                  ignore_eos=True, lora="r4"))
        )  # fmt: skip
        await asyncio.sleep(0.05)
        engine.unload_lora("r4")
        with pytest.raises(UnknownAdapterError):
            await engine.generate(PROMPT, greedy("r4"))
        finished = await running
        assert finished.token_ids[:NEW_TOKENS] == oracle.greedy("r4", OTHER, NEW_TOKENS)
        await engine.generate(PROMPT, greedy(None))  # a step after the last r4 request
        registry = engine.executor.loras  # type: ignore[attr-defined]
        await asyncio.sleep(0.05)
        assert "r4" not in registry.paths


@pytest.mark.asyncio
@pytest.mark.parametrize("method", ["ngram", "draft"])
async def test_speculation_verifies_under_the_requests_adapter(
    model_dir: Path, adapters: dict[str, Path], oracle: PeftOracle, method: str
) -> None:
    speculative: dict[str, object] = {"method": method, "num_speculative_tokens": 3}
    if method == "draft":
        speculative["model"] = str(model_dir)  # the base as the draft: it guesses bare
    config = engine_config(model_dir, loras={"r8": str(adapters["r8"])}, speculative=speculative)
    prompt = [1, *[300, 301, 302, 303] * 8]  # repeats: prompt lookup has guesses to make
    async with AsyncEngine(config) as engine:
        for lora in ("r8", None):
            out = await engine.generate(prompt, greedy(lora))
            assert out.token_ids == oracle.greedy(lora, prompt, NEW_TOKENS), lora


@pytest.mark.asyncio
async def test_a_name_loaded_again_never_meets_the_old_weights(
    model_dir: Path, adapters: dict[str, Path], oracle: PeftOracle
) -> None:
    """Over the old load or after an unload, a name's new weights start from an empty cache,
    and a request in flight under the old weights finishes under them."""
    config = engine_config(model_dir, loras={"a": str(adapters["r4"])})
    async with AsyncEngine(config) as engine:
        params = greedy("a")
        first = await engine.generate(PROMPT, params)
        assert first.token_ids == oracle.greedy("r4", PROMPT, NEW_TOKENS)
        running = asyncio.create_task(
            engine.generate(OTHER, SamplingParams(max_new_tokens=40, temperature=0.0,
                                                  ignore_eos=True, lora="a"))
        )  # fmt: skip
        await asyncio.sleep(0.05)
        await engine.load_lora("a", str(adapters["r8"]))  # over the old load
        replaced = await engine.generate(PROMPT, params)
        assert replaced.usage.cached_tokens == 0  # the r4 pages are not the r8 adapter's
        assert replaced.token_ids == oracle.greedy("r8", PROMPT, NEW_TOKENS)
        assert (await running).token_ids[:NEW_TOKENS] == oracle.greedy("r4", OTHER, NEW_TOKENS)
        engine.unload_lora("a")
        await engine.load_lora("a", str(adapters["r4"]))  # after an unload
        again = await engine.generate(PROMPT, params)
        assert again.usage.cached_tokens == 0 and again.token_ids == first.token_ids
        assert params.lora == "a"  # the caller's parameters are left as they were
        await engine.generate(PROMPT, greedy(None))  # a step after the replaced loads' last
        await asyncio.sleep(0.05)
        assert sorted(engine.executor.loras.paths) == ["a/3"]  # type: ignore[attr-defined]


@pytest.mark.asyncio
async def test_least_recently_used_adapters_are_read_back_from_disk(
    model_dir: Path, adapters: dict[str, Path], oracle: PeftOracle
) -> None:
    loras = {name: str(path) for name, path in adapters.items()}
    config = engine_config(model_dir, loras=loras, max_cpu_loras=1, enable_prefix_cache=False)
    async with AsyncEngine(config) as engine:
        registry = engine.executor.loras  # type: ignore[attr-defined]
        assert len(registry.loaded) == 1
        for lora in ("r4", "r8", "r4", "r16"):
            out = await engine.generate(PROMPT, greedy(lora))
            assert out.token_ids == oracle.greedy(lora, PROMPT, NEW_TOKENS)
            assert registry.loaded == [lora]
        assert registry.loads_from_disk >= 3


@pytest.mark.asyncio
async def test_the_simulator_starts_with_the_adapters_the_engine_holds_at_start(
    model_dir: Path, adapters: dict[str, Path]
) -> None:
    loras = {name: str(path) for name, path in adapters.items()}
    config = engine_config(model_dir, loras=loras, max_loras=2, max_cpu_loras=2)
    async with AsyncEngine(config) as engine:
        held = engine.executor.loras.loaded  # type: ignore[attr-defined]
    simulated = LoraCharges(
        SimLoras.for_config(config.max_cpu_loras), {}, loaded=tuple(config.loras)
    )
    assert held == list(simulated.resident) == list(loras)[-2:]


@pytest.mark.asyncio
async def test_an_adapter_whose_files_are_gone_fails_only_its_own_requests(
    model_dir: Path, adapters: dict[str, Path], oracle: PeftOracle, tmp_path: Path
) -> None:
    """With max_cpu_loras, an adapter dropped from memory is read back when a request for it
    arrives, before any step runs it: when its directory is gone, only its requests fail (a
    clear error naming it) and the base's and other adapters' requests in the same steps finish
    with their exact tokens; while its weights are in memory it goes on serving."""
    gone = tmp_path / "gone"
    shutil.copytree(adapters["r4"], gone)
    loras = {"gone": str(gone), "r8": str(adapters["r8"])}
    config = engine_config(model_dir, loras=loras, max_cpu_loras=1, enable_prefix_cache=False)
    long = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(config) as engine:
        registry = engine.executor.loras  # type: ignore[attr-defined]
        assert (await engine.generate(PROMPT, greedy("gone"))).token_ids == oracle.greedy(
            "r4", PROMPT, NEW_TOKENS
        )
        shutil.rmtree(gone)
        # in memory: it serves on
        out = await engine.generate(OTHER, greedy("gone"))
        assert out.token_ids == oracle.greedy("r4", OTHER, NEW_TOKENS)
        await engine.generate(PROMPT, greedy("r8"))  # drops "gone" from memory
        assert registry.loaded == ["r8"]
        # a base request runs while requests for the lost adapter arrive
        running = asyncio.create_task(engine.generate(OTHER, long))
        await asyncio.sleep(0.05)
        results = await asyncio.gather(
            engine.generate(PROMPT, greedy("gone")),
            engine.generate(PROMPT, greedy("r8")),
            engine.generate(PROMPT, greedy(None)),
            engine.generate(OTHER, greedy("gone")),
            return_exceptions=True,
        )
        for failed in (results[0], results[3]):
            assert isinstance(failed, AdapterUnavailableError), failed
            assert "'gone'" in str(failed) and failed.param == "model"
        for done, lora in ((results[1], "r8"), (results[2], None)):
            assert isinstance(done, GenerateOutput), done
            assert done.token_ids == oracle.greedy(lora, PROMPT, NEW_TOKENS), lora
        base = await running
        assert base.token_ids[:NEW_TOKENS] == oracle.greedy(None, OTHER, NEW_TOKENS)
        assert base.finish_reason == "length" and len(base.token_ids) == 40
        # it stays unavailable until unloaded; then it is unknown
        with pytest.raises(AdapterUnavailableError):
            await engine.generate(PROMPT, greedy("gone"))
        engine.unload_lora("gone")
        with pytest.raises(UnknownAdapterError):
            await engine.generate(PROMPT, greedy("gone"))
        assert engine.lora_adapters == {"r8": str(adapters["r8"])}
