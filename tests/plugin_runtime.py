"""A runtime from one module, as a plug-in registers it (GATEWAY_PLUGINS=tests.plugin_runtime): the
"echo" format on the CPU engine and on an engine of its own ("echo"), with its own probe, finder,
options, converter (`gateway convert --to echo --voice loud`) and engine factory. Its engine is the
scripted fake engine, answering under its own runtime name."""

from __future__ import annotations

import json
from dataclasses import replace

from pydantic import BaseModel, ConfigDict

from engines.base import EngineConfig
from engines.host import HostCapabilities, PlatformRuntime
from engines.registry import register_runtime
from engines.runtimes import Converter, ConvertJob, Device, Found, Offer, Preference, Runtime, Skip, register
from tests.fakes import FakeEngine

NAME = "echo"
ANSWER = "hello from a plug-in runtime"


class EchoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    greeting: str = ANSWER


def probe(host: HostCapabilities) -> HostCapabilities:
    found = PlatformRuntime(True, "", "echo runtime (tests/plugin_runtime.py)")
    return host.with_found(NAME, found)


def find(host: HostCapabilities, pref: Preference) -> Found:
    rt = host.runtime(NAME)
    if not rt.available:
        return [], [Skip(f"{NAME}/cpu", rt.reason, "unusable")]
    return [Device("cpu")], []


def report(host: HostCapabilities) -> list[str]:
    rt = host.runtime(NAME)
    return [f"{'Echo':<9} {'available: ' + rt.detail if rt.available else rt.reason}"]


def to_echo(job: ConvertJob) -> None:
    """The "artifact": which model it was made from, at which precision, in which voice."""
    config = json.loads((job.checkpoint / "config.json").read_text())
    job.progress(f"echoing {config['model_type']} in a {job.variant} voice")
    (job.out / "echo.json").write_text(json.dumps({"model_type": config["model_type"], "precision": job.precision,
                                                   "voice": job.variant}))


RUNTIME = register(Runtime(
    name=NAME,
    format="echo",
    offers=(Offer("cpu", find), Offer("echo", find)),
    engine_module=__name__,
    probe=probe,
    report=report,
    report_json=lambda host: {"echo": {"available": host.runtime(NAME).available}},
    install={"*": "pip install echo-runtime"},
    convert=Converter("echo", to_echo, needs=("json",), precisions=("fp32", "fp8"), variants=("quiet", "loud"),
                      variant_flag="voice", variant_help="echo: how loud the echo is"),
    options=EchoOptions,
    fingerprint=lambda host, lib_path: "echo 1.0",
))


class EchoEngine(FakeEngine):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config, script=ANSWER)
        self.info = replace(self.info, runtime=NAME, version="1.0")


@register_runtime(NAME)
def create_echo(config: EngineConfig) -> EchoEngine:
    return EchoEngine(config)
