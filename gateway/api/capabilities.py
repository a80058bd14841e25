"""What a model really does here: a short probe of each feature a client may count on, run on the
real engine through the same path as any request (`gateway check MODEL`, `POST
/v1/models/{id}/check`), cached per model file, template and engine, and shown in `/v1/models` and
`gateway ls`.

Each probe is a small request and a verdict on what came back: ok, not ok with the reason (what
the model did instead), or not applicable (a model that does not reason). The verdicts are about
this model with this template on this engine: a small model that answers in text where a tool
call was asked for is "not ok" for native tool use even though the grammar would hold its calls
well-formed under `required`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gateway.api.serving import Service
from gateway.chat import formats
from gateway.chat.template import template_of
from gateway.conversation import (
    ArgumentsDelta,
    CallStarted,
    Conversation,
    Finished,
    Output,
    ReasoningDelta,
    Sampling,
    TextDelta,
    ToolCall,
    ToolChoice,
    ToolSpec,
    Turn,
)
from gateway.host.jsonfile import JsonFile
from gateway.models.pool import Loaded
from gateway.models.registry import ModelSpec

log = logging.getLogger(__name__)

WEATHER = ToolSpec("get_weather", "Current weather in a city",
                   {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
TIME = ToolSpec("get_time", "The current time in a city",
                {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
ANSWER = {"type": "object", "properties": {"city": {"type": "string"}, "temp_c": {"type": "number"}},
          "required": ["city", "temp_c"], "additionalProperties": False}
MAX_TOKENS = 160


@dataclass(frozen=True)
class Finding:
    name: str
    ok: bool | None  # None: does not apply to this model
    detail: str


@dataclass
class Report:
    model: str
    format: str
    key: str  # what the verdicts hold for: the model file, its engine, its template
    at: float = field(default_factory=time.time)
    seconds: float = 0.0
    findings: list[Finding] = field(default_factory=list)

    def summary(self) -> str:
        """`5/8 ok` (probes that apply)."""
        applied = [f for f in self.findings if f.ok is not None]
        return f"{sum(1 for f in applied if f.ok)}/{len(applied)} ok"


@dataclass
class _Answer:
    text: str = ""
    reasoning: str = ""
    calls: tuple[ToolCall, ...] = ()
    finish: str = ""
    stop_sequence: str | None = None
    streamed_args: dict[int, str] = field(default_factory=dict)


def _conv(ask: str, tools: tuple[ToolSpec, ...] | None = None, choice: ToolChoice | None = None,
          output: Output | None = None, thinking: bool | None = None, stop: tuple[str, ...] = ()) -> Conversation:
    return Conversation((Turn.of("user", ask),), tools, choice, True, output, thinking,
                        Sampling(temperature=0.0, max_tokens=MAX_TOKENS, stop=stop))


async def _run(service: Service, spec: ModelSpec, conv: Conversation) -> _Answer:
    p = await service.prepare_conversation(spec, conv, 1, "check", time.perf_counter())
    out = _Answer()
    async with contextlib.aclosing(service.conversation_events(p)) as events:
        async for _, e in events:
            if isinstance(e, TextDelta):
                out.text += e.text
            elif isinstance(e, ReasoningDelta):
                out.reasoning += e.text
            elif isinstance(e, CallStarted):
                out.streamed_args[e.call] = ""
            elif isinstance(e, ArgumentsDelta):
                out.streamed_args[e.call] = out.streamed_args.get(e.call, "") + e.text
            elif isinstance(e, Finished):
                out.calls, out.finish, out.stop_sequence = e.calls, e.reason, e.stop_sequence
    return out


def _said(a: _Answer) -> str:
    text = " ".join(a.text.split())
    return f"answered in text instead: {text[:80]!r}" if text else f"no call and no text (finish {a.finish})"


def _calls(a: _Answer, tools: dict[str, ToolSpec]) -> str | None:
    """None when every call names a tool and its arguments follow that tool's schema, else why not."""
    import jsonschema

    for c in a.calls:
        if c.name not in tools:
            return f"called {c.name!r}, not one of the tools"
        try:
            jsonschema.validate(json.loads(c.arguments), tools[c.name].parameters or {})
        except (ValueError, jsonschema.ValidationError) as exc:
            return f"{c.name}'s arguments {c.arguments!r} are not valid: {str(exc).splitlines()[0]}"
    return None


def _call_list(a: _Answer) -> str:
    return ", ".join(f"{c.name}({c.arguments})" for c in a.calls)


async def _tools(service: Service, spec: ModelSpec) -> Finding:
    a = await _run(service, spec, _conv("What is the weather in Paris? Use the get_weather tool.", (WEATHER,)))
    if not a.calls:
        return Finding("tools", False, _said(a))
    bad = _calls(a, {"get_weather": WEATHER})
    return Finding("tools", bad is None, bad or f"called {_call_list(a)}")


async def _parallel(service: Service, spec: ModelSpec) -> Finding:
    a = await _run(service, spec, _conv("Get the weather in Paris and the weather in Rome, with two calls of "
                                        "get_weather at once.", (WEATHER,)))
    bad = _calls(a, {"get_weather": WEATHER})
    if bad is not None:
        return Finding("parallel tool calls", False, bad)
    if len(a.calls) < 2:
        return Finding("parallel tool calls", False, f"made {len(a.calls)} call(s): {_call_list(a) or _said(a)}")
    return Finding("parallel tool calls", True, f"called {_call_list(a)}")


async def _streamed(service: Service, spec: ModelSpec) -> Finding:
    a = await _run(service, spec, _conv("What is the weather in Paris?", (WEATHER,), ToolChoice("required")))
    if not a.calls:
        return Finding("streamed tool calls", False, _said(a))
    joined = [a.streamed_args.get(i, "") for i in range(len(a.calls))]
    if joined != [c.arguments for c in a.calls]:
        return Finding("streamed tool calls", False, f"fragments {joined!r} differ from the calls' arguments")
    return Finding("streamed tool calls", True, f"{len(a.calls)} call(s), fragments equal the arguments")


async def _required(service: Service, spec: ModelSpec) -> Finding:
    a = await _run(service, spec, _conv("Hello!", (WEATHER, TIME), ToolChoice("required")))
    bad = _calls(a, {"get_weather": WEATHER, "get_time": TIME}) if a.calls else _said(a)
    return Finding("tool_choice required", bad is None, bad or f"called {_call_list(a)}")


async def _named(service: Service, spec: ModelSpec) -> Finding:
    a = await _run(service, spec, _conv("What is the weather in Paris?", (WEATHER, TIME), ToolChoice("named", "get_time")))
    if not a.calls:
        return Finding("tool_choice named", False, _said(a))
    if any(c.name != "get_time" for c in a.calls):
        return Finding("tool_choice named", False, f"called {_call_list(a)}, not only get_time")
    bad = _calls(a, {"get_time": TIME})
    return Finding("tool_choice named", bad is None, bad or f"called {_call_list(a)}")


async def _json_schema(service: Service, spec: ModelSpec) -> Finding:
    import jsonschema

    a = await _run(service, spec, _conv("The weather in Paris is 18 degrees. Answer as JSON.",
                                        output=Output("json_schema", ANSWER)))
    try:
        jsonschema.validate(json.loads(a.text), ANSWER)
    except (ValueError, jsonschema.ValidationError) as exc:
        return Finding("JSON schema output", False, f"{a.text[:80]!r}: {str(exc).splitlines()[0]}")
    return Finding("JSON schema output", True, a.text[:80])


async def _reasoning(service: Service, spec: ModelSpec) -> list[Finding]:
    loaded = await service.manager.get(spec)
    from gateway.api import reasoning

    template = template_of(loaded.engine.info)
    if template is None or not reasoning.reasons(spec, template.traits):
        return [Finding("reasoning on", None, "the model does not reason"),
                Finding("reasoning off", None, "the model does not reason")]
    on = await _run(service, spec, _conv("What is 17 + 25?", thinking=True))
    off = await _run(service, spec, _conv("What is 17 + 25?", thinking=False))
    return [Finding("reasoning on", bool(on.reasoning.strip()),
                    f"{len(on.reasoning)} characters of reasoning apart from the answer" if on.reasoning.strip()
                    else "no reasoning came back"),
            Finding("reasoning off", not off.reasoning.strip(),
                    "answered without reasoning" if not off.reasoning.strip()
                    else f"still reasoned ({len(off.reasoning)} characters)")]


async def _stop(service: Service, spec: ModelSpec) -> Finding:
    a = await _run(service, spec, _conv("Write one sentence about the weather.", stop=("e",)))
    if "e" in a.text:
        return Finding("stop strings", False, f"the stop string came back: {a.text[:60]!r}")
    if a.stop_sequence != "e":
        return Finding("stop strings", False, f"finished with {a.finish!r} without the stop string: {a.text[:60]!r}")
    return Finding("stop strings", True, f"stopped at 'e' ({a.text.strip()[:40]!r})")


Probe = Callable[[Service, ModelSpec], Awaitable[Finding | list[Finding]]]
PROBES: tuple[tuple[str, Probe], ...] = (
    ("tools", _tools), ("parallel tool calls", _parallel), ("streamed tool calls", _streamed),
    ("tool_choice required", _required), ("tool_choice named", _named), ("JSON schema output", _json_schema),
    ("stop strings", _stop), ("reasoning", _reasoning))


IDLE_POLL_S = 0.25  # how often a background check looks whether the model's users are done


async def _idle(service: Service, model: str) -> None:
    """Until no request of `model` runs or waits in admission."""
    while (g := service.admission.gates().get(model)) is not None and (g.running or g.waiting):
        await asyncio.sleep(IDLE_POLL_S)


async def check(service: Service, spec: ModelSpec, background: bool = False) -> Report:
    """Every probe on `spec`'s model, loading it if needed. A probe the model's engine refuses
    (an error in the request) is not ok with that error. In the `background` (on a model's first
    load) the probes run one at a time, each once no request of the model runs or waits, so a user
    waits for one probe at most; asked for, as many at once as the engine has slots."""
    t0 = time.perf_counter()
    loaded = await service.manager.get(spec)
    fmt = formats.serving(spec.tool_format, template_of(loaded.engine.info))
    report = Report(spec.id, fmt.name, key_of(loaded.check_key, fmt.name, spec.chat_template))

    slots = asyncio.Semaphore(1 if background else max(1, loaded.engine.info.parallel))

    async def one(name: str, probe: Probe) -> list[Finding]:
        try:
            async with slots:
                if background:
                    await _idle(service, spec.id)
                found = await probe(service, spec)
            return found if isinstance(found, list) else [found]
        except Exception as exc:  # noqa: BLE001 - a refused probe is a finding, not the check's end
            return [Finding(name, False, f"error: {type(exc).__name__}: {exc}")]

    # As many at once as the engine has slots: it batches them, and none waits in admission.
    for found in await asyncio.gather(*(one(n, p) for n, p in PROBES)):
        report.findings += found
    report.seconds = round(time.perf_counter() - t0, 2)
    return report


def key_of(engine_key: str, fmt: str, template: str | None) -> str:
    return f"{engine_key}|{fmt}|{hashlib.blake2b((template or '').encode(), digest_size=8).hexdigest()}"


class ReportCache(JsonFile):
    """The last report of each model, in a JSON file of the model cache."""

    @classmethod
    def of(cls, cache_dir: str | Path) -> ReportCache:
        """The reports of a model cache."""
        return cls(Path(cache_dir) / "capability-checks.json")

    def get(self, model: str) -> Report | None:
        item = self.read().get(model)
        if not isinstance(item, dict):
            return None
        try:
            return Report(item["model"], item["format"], item["key"], item["at"], item.get("seconds", 0.0),
                          [Finding(**f) for f in item["findings"]])
        except (KeyError, TypeError):
            return None

    def put(self, report: Report) -> None:
        self.set(report.model, asdict(report))


def check_on_load(service: Service, cache: ReportCache) -> Callable[[Loaded], None]:
    """A hook for ModelManager.on_loaded: the check of a model whose kept report is for another
    file, engine or template (or none), in the background; its report kept."""
    running: set[asyncio.Task[None]] = set()

    async def run(spec: ModelSpec) -> None:
        try:
            cache.put(await check(service, spec, background=True))
        except Exception as exc:  # noqa: BLE001 - a check that cannot run leaves the model served
            log.warning("the capability check of %s did not run: %s", spec.id, exc)

    def hook(entry: Loaded) -> None:
        if entry.spec.embedding_only:  # nothing to probe: it serves no chat
            return
        fmt = formats.serving(entry.spec.tool_format, template_of(entry.engine.info))
        kept = cache.get(entry.spec.id)
        if kept is not None and kept.key == key_of(entry.check_key, fmt.name, entry.spec.chat_template):
            return
        task = asyncio.get_running_loop().create_task(run(entry.spec))
        running.add(task)
        task.add_done_callback(running.discard)

    return hook
