"""A runtime from one module, as a plug-in registers it (GATEWAY_PLUGINS=tests.plugin_runtime): the
"echo" format on the CPU engine, with its own probe, finder, options and engine factory. Its engine
is the scripted fake engine, answering under its own runtime name."""

from __future__ import annotations

from dataclasses import replace

from pydantic import BaseModel, ConfigDict

from engines.base import EngineConfig
from engines.host import HostCapabilities, PlatformRuntime
from engines.registry import register_runtime
from engines.runtimes import Device, Found, Offer, Preference, Runtime, Skip, register
from tests.fakes import FakeEngine

NAME = "echo"
ANSWER = "hello from a plug-in runtime"


class EchoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    greeting: str = ANSWER


def probe(host: HostCapabilities) -> HostCapabilities:
    found = PlatformRuntime(True, "", "echo runtime (tests/plugin_runtime.py)")
    return replace(host, runtimes={**host.runtimes, NAME: found})


def find(host: HostCapabilities, pref: Preference) -> Found:
    rt = host.runtime(NAME)
    if not rt.available:
        return [], [Skip(f"{NAME}/cpu", rt.reason, "unusable")]
    return [Device("cpu")], []


def report(host: HostCapabilities) -> list[str]:
    rt = host.runtime(NAME)
    return [f"{'Echo':<9} {'available: ' + rt.detail if rt.available else rt.reason}"]


RUNTIME = register(Runtime(
    name=NAME,
    format="echo",
    offers=(Offer("cpu", find),),
    engine_module=__name__,
    probe=probe,
    report=report,
    report_json=lambda host: {"echo": {"available": host.runtime(NAME).available}},
    install={"*": "pip install echo-runtime"},
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
