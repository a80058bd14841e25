"""`gateway convert`: artifacts in the cache that the registry finds, the CLI, and the CoreML spec."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.cli import main
from gateway.models.convert import MANIFEST, ConversionError, convert
from gateway.models.registry import ModelUnavailable, Registry, load_registry
from tests.conftest import MODEL, ROOT

pytestmark = [
    # coremltools: numpy overflow in one of its graph passes, and its own deprecations.
    pytest.mark.filterwarnings("ignore::RuntimeWarning:coremltools.*"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def test_onnx_artifact_is_recorded_and_resolved(onnx_fp32: Path, default_registry: Registry) -> None:
    spec = default_registry.models[MODEL]
    assert onnx_fp32 == default_registry.converted_dir(spec, "onnx", "fp32", "cpu")
    assert onnx_fp32.name == "onnx-fp32-cpu"
    assert {"genai_config.json", "model.onnx", "tokenizer.json", "chat_template.jinja"} <= {p.name for p in onnx_fp32.iterdir()}
    manifest = json.loads((onnx_fp32 / MANIFEST).read_text())
    assert (manifest["model"], manifest["format"], manifest["precision"], manifest["provider"]) == (MODEL, "onnx", "fp32", "cpu")
    # models.yaml lists no onnx format: the registry still finds the converted artifact.
    assert "onnx" not in spec.formats
    assert default_registry.resolve(spec, "onnx") == onnx_fp32
    assert "onnx" in default_registry.formats(spec)
    # Converting again is a no-op that returns the cached artifact.
    msgs: list[str] = []
    assert convert(default_registry, spec, "onnx", "fp32", "cpu", progress=msgs.append) == onnx_fp32
    assert "already converted" in msgs[0]


def _registry(tmp_path: Path, onnx: dict[str, Any] | None) -> Registry:
    data = yaml.safe_load((ROOT / "models.yaml").read_text())
    spec = next(m for m in data["models"] if m["id"] == MODEL)
    if onnx is not None:
        spec["formats"]["onnx"] = onnx
    data["models"] = [spec]
    (tmp_path / "models.yaml").write_text(yaml.safe_dump(data))
    return load_registry(tmp_path / "models.yaml", cache_dir=tmp_path / "cache")


def _fake_artifact(reg: Registry, fmt: str, precision: str, provider: str | None, finished: bool = True) -> Path:
    d = reg.converted_dir(reg.models[MODEL], fmt, precision, provider)
    d.mkdir(parents=True)
    if finished:
        (d / MANIFEST).write_text("{}")
    return d


def test_resolve_prefers_pinned_then_best_artifact(tmp_path: Path) -> None:
    reg = _registry(tmp_path, None)
    spec = reg.models[MODEL]
    with pytest.raises(ModelUnavailable, match=f"gateway convert --model {MODEL} --to onnx"):
        reg.resolve(spec, "onnx")
    _fake_artifact(reg, "onnx", "fp32", "cpu", finished=False)  # interrupted: never used
    assert reg.local_path(spec, "onnx") is None
    int4 = _fake_artifact(reg, "onnx", "int4", "cpu")
    assert reg.resolve(spec, "onnx") == int4
    (reg.converted_dir(spec, "onnx", "fp32", "cpu") / MANIFEST).write_text("{}")
    assert reg.resolve(spec, "onnx").name == "onnx-fp32-cpu"  # quality first when not pinned
    pinned = _registry(tmp_path, {"converted": {"precision": "int4"}})
    assert pinned.resolve(pinned.models[MODEL], "onnx") == int4
    cuda = _registry(tmp_path, {"converted": {"provider": "cuda"}})
    with pytest.raises(ModelUnavailable, match="no converted onnx artifact"):
        cuda.resolve(cuda.models[MODEL], "onnx")


def test_source_needs_exactly_one_kind(tmp_path: Path) -> None:
    from gateway.models.registry import RegistryError

    with pytest.raises(RegistryError, match="exactly one of"):
        _registry(tmp_path, {"converted": {"precision": "fp32"}, "path": "x"})


def test_cli_convert(onnx_fp32: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", "--model", MODEL, "--to", "onnx", "--precision", "fp32", "--config", str(ROOT / "models.yaml")]) == 0
    out = capsys.readouterr().out
    assert "already converted" in out and out.strip().endswith(str(onnx_fp32))
    assert main(["convert", "--model", "nope", "--to", "onnx", "--config", str(ROOT / "models.yaml")]) == 2


def test_convert_rejects_bad_arguments(default_registry: Registry) -> None:
    spec = default_registry.models[MODEL]
    with pytest.raises(ConversionError, match="precision"):
        convert(default_registry, spec, "onnx", "fp8")
    with pytest.raises(ConversionError, match="provider"):
        convert(default_registry, spec, "onnx", "fp32", "rocm")


def test_coreml_program_has_kv_cache_states(coreml_fp16: Path, default_registry: Registry) -> None:
    import coremltools as ct
    from coremltools.proto import FeatureTypes_pb2 as ft

    assert coreml_fp16.name == "coreml-fp16"
    assert default_registry.resolve(default_registry.models[MODEL], "coreml") == coreml_fp16
    spec = ct.utils.load_spec(str(coreml_fp16 / "model.mlpackage"))
    assert spec.WhichOneof("Type") == "mlProgram"
    assert spec.specificationVersion >= 9  # iOS 18 / macOS 15: needed for states
    desc = spec.description
    inputs = {i.name: i.type.multiArrayType.dataType for i in desc.input}
    assert inputs == {"input_ids": ft.ArrayFeatureType.INT32, "causal_mask": ft.ArrayFeatureType.FLOAT16}
    assert [o.name for o in desc.output] == ["logits"]
    states = {s.name: list(s.type.stateType.arrayType.shape) for s in desc.state}
    assert states == {"keyCache": [30, 1, 3, 2048, 64], "valueCache": [30, 1, 3, 2048, 64]}
    assert {"tokenizer.json", "chat_template.jinja", "coreml_config.json"} <= {p.name for p in coreml_fp16.iterdir()}


def test_a_sentencepiece_decoder_on_a_byte_level_tokenizer_is_repaired(tmp_path: Path) -> None:
    """What transformers 5.17 wrote on the H100 host: a byte-level BPE tokenizer with a
    SentencePiece decoder chain. ORT GenAI then decoded spaces as <|endoftext|>."""
    import json

    from tokenizers import Tokenizer

    from gateway.models.convert import ROUND_TRIP_PROBE, repair_byte_level_decoder
    from gateway.models.registry import load_registry

    reg = load_registry(ROOT / "models.yaml")
    good = reg.converted_root(reg.models[MODEL]) / "hf-fp32" / "tokenizer.json"
    if not good.is_file():
        pytest.skip("needs the converted checkpoint (made by the conversion tests that run first)")
    data = json.loads(good.read_text())
    data["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}]}
    broken = tmp_path / "tokenizer.json"
    broken.write_text(json.dumps(data))
    assert repair_byte_level_decoder(broken) is True
    tok = Tokenizer.from_file(str(broken))
    assert tok.decode(tok.encode(ROUND_TRIP_PROBE, add_special_tokens=False).ids) == ROUND_TRIP_PROBE
    assert repair_byte_level_decoder(broken) is False  # already right: left alone


def test_an_executorch_program_resolves_per_delegate(tmp_path: Path) -> None:
    """A .pte is lowered for one delegate: `pte:vulkan` never resolves to the XNNPACK program."""
    reg = _registry(tmp_path, None)
    spec = reg.models[MODEL]
    xnn = _fake_artifact(reg, "pte", "fp32", "xnnpack")
    assert reg.formats(spec)[-2:] == ["pte", "pte:xnnpack"]
    assert reg.resolve(spec, "pte:xnnpack") == xnn and reg.local_path(spec, "pte:vulkan") is None
    with pytest.raises(ModelUnavailable, match=f"gateway convert --model {MODEL} --to executorch --delegate vulkan"):
        reg.resolve(spec, "pte:vulkan")
    vk = _fake_artifact(reg, "pte", "fp32", "vulkan")
    assert reg.resolve(spec, "pte:vulkan") == vk and reg.resolve(spec, "pte:xnnpack") == xnn
    assert {"pte:xnnpack", "pte:vulkan"} <= set(reg.formats(spec))
