"""`gateway` command line: serve, models, devices, convert, bench, parity."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from engines import gcpause
from engines.envconfig import knobs
from engines.runtimes import converters, load_plugins
from engines.tuning import EngineTuning
from gateway.host.functional_check import CheckCache
from gateway.host.hardware import probe_host
from gateway.host.placement import from_setting
from gateway.host.selection import Preference, SelectionError, plan
from gateway.models.gguf_info import parameter_size
from gateway.models.registry import ModelSpec, Registry, RegistryError, load_registry, source_label
from gateway.settings import SettingError, Settings
from gateway.settings_flags import add_setting_options, given_settings

log = logging.getLogger("gateway")
# The settings `gateway worker` takes as options (the rest come from GATEWAY_* variables).
WORKER_SETTINGS = ("engine", "runtime", "device", "parallel", "sequences", "threads", "config")


def _serve_settings(args: argparse.Namespace) -> Settings:
    """`serve`'s settings: GATEWAY_* variables under its options (ValueError for a malformed one)."""
    EngineTuning.from_env()  # the engines' knobs too: a malformed one is said now, not at a load
    return Settings.from_env(**given_settings(args, Settings))


def _serve(args: argparse.Namespace) -> int:
    from gateway.app import create_app
    from gateway.server import run

    try:
        settings = _serve_settings(args)
    except ValueError as exc:  # a malformed option or GATEWAY_* variable: said as such, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings.api_keys()
    except OSError as exc:
        print(f"error: cannot read the API key file: {exc}", file=sys.stderr)
        return 2
    try:
        registry = load_registry(settings.config)
        default = registry.get(settings.model or registry.default)
        if default is None and settings.model:
            pulled = _pull_first(settings.model)
            if pulled is False:
                return 1
            if pulled:
                registry.refresh_user()
                default = registry.get(settings.model)
        if default is None:
            print(f"error: unknown model {settings.model!r}; known: {', '.join(registry.models)}", file=sys.stderr)
            return 2
        host = probe_host() if not args.cluster else None
        if args.recheck:
            CheckCache(Path(registry.cache_dir) / "functional-checks.json").clear()
        if args.cluster:
            try:
                from gateway.cluster.runtime import serve_on_ray
            except ImportError as exc:
                print(f"error: --cluster needs Ray Serve: pip install 'llm-gateway[cluster]' ({exc})", file=sys.stderr)
                return 2
            return serve_on_ray(settings, registry, args.cluster)
        assert host is not None
        where = f"{len(default.workers)} remote worker(s)" if default.workers else ""
        if not default.workers:
            the_plan = plan(default, host, Preference(settings.engine, settings.runtime, from_setting(settings.device)[0]),
                            registry.formats(default))
            first = the_plan.candidates[0]
            where = f"first choice {first.label} on {first.device} ({len(the_plan.candidates)} candidate(s))"
        app = create_app(settings, registry, host=host)
    except (RegistryError, SelectionError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log.info("serving %s at http://%s:%d/v1; %s", default.id, settings.host, settings.port, where)
    gcpause.settle()  # imports, schemas and routes stay; later collections do not walk them
    if not run(app, settings.host, settings.port, settings.log_level.lower(), settings.drain_timeout):
        print(f"error: {app.state.startup_error or 'the server did not start (see the log above)'}", file=sys.stderr)
        return 2
    return 0


def _models(args: argparse.Namespace) -> int:
    registry = _registry(args.config)
    if registry is None:
        return 2
    if args.download:
        spec = registry.get(args.download)
        if spec is None:
            print(f"error: unknown model {args.download!r}", file=sys.stderr)
            return 2
        logging.basicConfig(level="INFO")
        for fmt in spec.formats:
            try:
                print(f"{spec.id} [{fmt}]: {registry.resolve(spec, fmt)}")
            except Exception as exc:  # noqa: BLE001 - reported to the user
                print(f"error: {exc}", file=sys.stderr)
                return 1
        return 0
    rows = [("ID", "FORMATS", "CONTEXT", "PRESENT", "DEFAULT")]
    for spec in registry.models.values():
        formats = registry.formats(spec)
        present = [f for f in formats if registry.local_path(spec, f) is not None]
        rows.append((
            spec.id, ",".join(formats), str(spec.context_length),
            ",".join(present) or "no (downloads on first use)", "*" if spec.id == registry.default else "",
        ))
    _print_table(rows)
    return 0


def _registry(config: str | None) -> Registry | None:
    """models.yaml (and the pulled models); None after saying why it cannot be read."""
    try:
        return load_registry(config or Settings.from_env().config)
    except RegistryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def _print_table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def _human(n: float, unit: str = "B") -> str:
    for prefix in ("", "K", "M", "G", "T"):
        if abs(n) < 1024 or prefix == "T":
            return f"{n:.0f} {prefix}{unit}" if prefix == "" else f"{n:.1f} {prefix}i{unit}"
        n /= 1024
    return f"{n:.1f}"


def _pull(args: argparse.Namespace) -> int:
    from gateway.models.hub import PullError, parse_name, pull

    name = parse_name(args.name)
    if name is None:
        print(f"error: {args.name!r} is not a Hub model name; use hf.co/<user>/<repo>[:<quant>]", file=sys.stderr)
        return 2
    logging.basicConfig(level="WARNING", format="%(levelname)s %(name)s: %(message)s")
    try:
        done = pull(name, context=args.context, mmproj=args.mmproj)
    except PullError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: the part downloaded is kept; the same command goes on from there", file=sys.stderr)
        return 130
    p = done.entry["pulled"]
    print(f"{'already present' if done.already else 'pulled'}: {done.model_id} ({p['quant']}, "
          f"{parameter_size(p['parameters'])} parameters, {_human(p['size_bytes'])}, context {done.entry['context_length']}"
          f" of {p['context_trained']} trained)")
    print(f"  file: {done.path}")
    if "mmproj" in done.entry:
        print(f"  vision projector: {done.entry['mmproj']['hf']['file']} (the model takes images)")
    print(f"  registered in {done.registry_file}")
    print(f"  serve it: gateway serve --model {done.model_id}")
    return 0


def _pull_first(model: str) -> bool | None:
    """`serve --model hf.co/...` of a model not pulled yet: pull it now (None: not a Hub name;
    False: the pull failed, said on stderr)."""
    from gateway.models.hub import PullError, parse_name, pull

    name = parse_name(model)
    if name is None:
        return None
    log.info("%s is not pulled yet: pulling it", model)
    try:
        done = pull(name)
    except PullError as exc:
        print(f"error: cannot pull {model}: {exc}", file=sys.stderr)
        return False
    log.info("pulled %s into %s", done.model_id, done.path)
    return True


def _gateway_models(url: str) -> dict[str, dict[str, object]] | None:
    """The running gateway's view of its models (/health), or None when no gateway answers at `url`."""
    import httpx

    try:
        r = httpx.get(url.rstrip("/") + "/health", timeout=3.0)
        body = r.json()
    except (httpx.HTTPError, ValueError):
        return None
    models = body.get("models") if isinstance(body, dict) else None
    return models if isinstance(models, dict) else None


def _default_url() -> str:
    s = Settings.from_env()
    host = "127.0.0.1" if s.host in ("0.0.0.0", "::", "") else s.host
    return f"http://{host}:{s.port}"


def _ls(args: argparse.Namespace) -> int:
    registry = _registry(args.config)
    if registry is None:
        return 2
    running = _gateway_models(args.url or _default_url())
    from gateway.api.capabilities import ReportCache
    from gateway.chat import formats

    checks = ReportCache.of(registry.cache_dir)
    rows = [("ID", "SOURCE", "QUANT", "PARAMS", "CONTEXT", "SIZE", "FORMAT", "CHECK", "LOADED")]
    for spec in registry.models.values():
        path = registry.local_path(spec, "gguf") if "gguf" in spec.formats else None
        source = source_label(spec) or "-"
        quant = params = ""
        template = spec.chat_template
        size = "not downloaded"
        if path is not None:
            try:
                from gateway.models.gguf_info import GGUFError, read_gguf

                info = read_gguf(path)
                quant, params = info.quantization, parameter_size(info.parameters)
                template = template or info.metadata.get("tokenizer.chat_template")
                size = _human(sum(f.stat().st_size for f in info.files))
            except (GGUFError, OSError):
                size = _human(path.stat().st_size)
        if spec.pulled is not None:
            quant = spec.pulled.quant or quant
        state = "?" if running is None else (
            "yes" if running.get(spec.id, {}).get("engine") else str(running.get(spec.id, {}).get("status", "no")))
        # The family format of its tool calls and reasoning (models.yaml's, else its template's).
        fmt = spec.tool_format or (formats.detect_text(template).name if template or path is not None else "?")
        report = checks.get(spec.id)
        rows.append((spec.id + (" *" if spec.id == registry.default else ""), source, quant, params,
                     str(spec.context_length), size, fmt, report.summary() if report is not None else "-", state))
    _print_table(rows)
    if running is None:
        print(f"(no gateway answers at {args.url or _default_url()}: LOADED unknown)")
    return 0


def _create(args: argparse.Namespace) -> int:
    """`ollama create NAME -f Modelfile`, here: FROM a model or a local GGUF (copied into the blob
    store), with SYSTEM, PARAMETER, MESSAGE, LICENSE."""
    from pydantic import ValidationError

    from gateway.api.errors import APIError
    from gateway.api.notes import Notes
    from gateway.api.ollama.api import CreateRequest, recipe
    from gateway.models.create import CreateError, check_name, create, store_blob
    from gateway.models.modelfile import ModelfileError, local_files, parse

    registry = _registry(args.config)
    if registry is None:
        return 2
    path = Path(args.file)
    try:
        mf = parse(path.read_text())
        files = local_files(mf, path.parent)
        body = CreateRequest.model_validate({
            "model": args.name, "system": mf.system, "parameters": mf.parameters or None,
            "messages": mf.messages or None, "license": mf.license or None, "template": mf.template,
            "adapters": dict.fromkeys(mf.adapters, "") or None, "stream": False, "quantize": args.quantize,
            **({"from": mf.from_} if files is None else {})})
        notes = Notes()
        rec = recipe(body, notes)
        model_id = check_name(registry, rec.name)
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (ModelfileError, CreateError) as exc:
        print(f"error: {path}: {exc}", file=sys.stderr)
        return 2
    except APIError as exc:
        print(f"error: {path}: {exc.message}", file=sys.stderr)
        return 2
    except ValidationError as exc:  # a PARAMETER or MESSAGE of the wrong type
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        print(f"error: {path}: {where}: {first['msg']}", file=sys.stderr)
        return 2
    if files is None:
        parent = registry.get(mf.from_) or registry.get(mf.from_.removesuffix(":latest"))
        if parent is None:
            print(f"error: FROM {mf.from_}: no such model (`gateway ls` lists them; `gateway pull` fetches "
                  "Hub models) and no such file", file=sys.stderr)
            return 2
        rec.parent = parent
    running = _gateway_models(args.url or _default_url())
    if running is not None and (running.get(model_id, {}).get("engine") or
                                running.get(model_id, {}).get("status") == "loading"):
        print(f"error: {model_id!r} is loaded by the gateway at {args.url or _default_url()}; unload it first",
              file=sys.stderr)
        return 1
    rec.progress = print
    try:
        for f in files or []:
            print(f"copying {f} into the blob store")
            rec.files[f.name] = store_blob(registry, f)
        entry, _ = create(registry, rec)
    except CreateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if exc.status < 500 else 1
    for name in sorted(notes.ignored):
        print(f"ignored: {name} (no sampler for it)")
    print(f"created {model_id} ({entry})")
    return 0


def _rm(args: argparse.Namespace) -> int:
    from gateway.models.hub import remove

    registry = _registry(args.config)
    if registry is None:
        return 2
    spec = registry.get(args.id)
    if spec is None:
        print(f"error: no model {args.id!r}; `gateway ls` lists them", file=sys.stderr)
        return 2
    if spec.id not in registry.user_files:
        print(f"error: {spec.id!r} is defined in {registry.file_path}, not pulled: edit that file to remove it",
              file=sys.stderr)
        return 2
    running = _gateway_models(args.url or _default_url())
    if running is not None and (running.get(spec.id, {}).get("engine") or
                                running.get(spec.id, {}).get("status") == "loading"):
        print(f"error: {spec.id!r} is loaded by the gateway at {args.url or _default_url()}; unload it first "
              f"(POST /models/{spec.id}/unload, or the web page)", file=sys.stderr)
        return 1
    freed, kept = remove(registry, spec)
    print(f"removed {spec.id}: freed {_human(freed)}"
          + (f"; kept {len(kept)} file(s) other models use: {', '.join(kept)}" if kept else ""))
    return 0


def _registry_and_spec(config: str, model: str | None) -> tuple[Registry, ModelSpec] | None:
    """models.yaml and the named (or default) model in it; None after printing why not."""
    registry = _registry(config)
    if registry is None:
        return None
    spec = registry.get(model or registry.default)
    if spec is None:
        print(f"error: unknown model {model!r}; known: {', '.join(registry.models)}", file=sys.stderr)
        return None
    return registry, spec


def _convert(args: argparse.Namespace) -> int:
    from gateway.models.convert import ConversionError, convert, targets
    from gateway.models.registry import ModelUnavailable

    found = _registry_and_spec(args.config or Settings.from_env().config, args.model)
    if found is None:
        return 2
    registry, spec = found
    logging.basicConfig(level="WARNING", format="%(levelname)s %(name)s: %(message)s")
    flag = targets()[args.to].variant_flag
    try:
        out = convert(registry, spec, args.to, args.precision, getattr(args, flag) if flag else None,
                      progress=lambda msg: print(msg, flush=True), force=args.force, show_output=True)
    except (ConversionError, ModelUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


def _worker(args: argparse.Namespace) -> int:
    """Serve one model to remote gateways over TCP (models.yaml `workers:` on the gateway's side)."""
    import asyncio
    import ssl

    from engines.worker.server import serve_tcp
    from gateway.models.pool import ModelManager

    host_part, _, port_part = args.listen.rpartition(":")
    if not host_part or not port_part.isdigit():
        print(f"error: --listen wants HOST:PORT, not {args.listen!r}", file=sys.stderr)
        return 2
    try:
        tokens = tuple(ln.strip() for ln in Path(args.token_file).read_text().splitlines() if ln.strip())
    except OSError as exc:
        print(f"error: cannot read the token file: {exc}", file=sys.stderr)
        return 2
    if not tokens or any(len(t) < 16 for t in tokens):
        print("error: the token file needs one token per line, each at least 16 characters", file=sys.stderr)
        return 2
    context = None
    if args.tls_cert:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(args.tls_cert, args.tls_key)
    try:
        settings = Settings.from_env(**given_settings(args, Settings), workers=False, isolate_check=False)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    found = _registry_and_spec(settings.config, settings.model)
    if found is None:
        return 2
    registry, spec = found

    async def run() -> None:
        manager = ModelManager(registry, settings)
        entry = await manager.get(spec)
        log.info("worker: %s on %s (%s); listening on %s", spec.id, entry.candidate.label, entry.candidate.device,
                 args.listen)
        try:
            await serve_tcp(entry.engine, host_part.strip("[]"), int(port_part), tokens, context)
        finally:
            await manager.close()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # noqa: BLE001 - the command's own error report
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _settings(args: argparse.Namespace) -> int:
    """The settings as the environment sets them, or the docs' tables generated from them."""
    from gateway.settings_docs import tables, write_tables

    serve = subcommand(build_parser(), "serve")
    if args.write:
        for name in args.write:
            path = Path(name)
            text = path.read_text()
            new = write_tables(text, serve)
            if new != text:
                path.write_text(new)
            print(f"{name}: {'updated' if new != text else 'up to date'}")
        return 0
    if args.markdown:
        print(tables(serve)[args.markdown], end="")
        return 0
    rows = [("SETTING", "VARIABLE", "VALUE")]
    for model in (Settings.from_env(), EngineTuning.from_env()):
        for k in knobs(type(model)).values():
            value = getattr(model, k.name)
            shown = ("-" if value is None else "(set)" if not k.info.repr
                     else ",".join(value) if isinstance(value, tuple) else str(value))
            rows.append((k.name, k.env, shown))
    _print_table(rows)
    return 0


def subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of one subcommand (`serve`) of `build_parser()`."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[name]
            return found
    raise KeyError(name)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gateway", description="OpenAI-compatible local LLM gateway")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve the OpenAI API")
    add_setting_options(s, Settings)
    s.add_argument("--recheck", action="store_true", help="forget cached functional-check results and check again")
    s.add_argument("--cluster", default=None, metavar="ray[://ADDRESS]",
                   help="serve on a Ray cluster (the `cluster` extra): `ray` joins this host's cluster or starts "
                        "one; ray://HOST:PORT connects to a remote head. Replicas per model: models.yaml `replicas`")
    s.set_defaults(func=_serve)
    m = sub.add_parser("models", help="list the registry and what is present locally")
    m.add_argument("--config", default=None)
    m.add_argument("--download", metavar="ID", help="fetch (or assemble) the model's files now")
    m.set_defaults(func=_models)
    pl = sub.add_parser("pull", help="download a GGUF from the Hugging Face Hub by name and register it")
    pl.add_argument("name", help="hf.co/<user>/<repo>[:<quant>] (Q4_K_M when no quantisation is named)")
    pl.add_argument("--context", type=int, default=None,
                    help="context length to register (default: the model's trained length, at most 8192)")
    pl.add_argument("--mmproj", default=None, metavar="FILE",
                    help="the vision projector to fetch beside the model (default: the repository's mmproj "
                         "GGUF, F16 first; none for a text model)")
    pl.set_defaults(func=_pull)
    ls = sub.add_parser("ls", help="list models: source, quantisation, size on disk, loaded or not")
    ls.add_argument("--config", default=None, help="models.yaml path")
    ls.add_argument("--url", default=None, help="the running gateway asked what is loaded (default: this host's)")
    ls.set_defaults(func=_ls)
    cr = sub.add_parser("create", help="make a model from a Modelfile (Ollama's): FROM a model or a GGUF file, "
                        "with SYSTEM, PARAMETER, MESSAGE, LICENSE")
    cr.add_argument("name", help="the new model's name")
    cr.add_argument("-f", "--file", default="Modelfile", help="the Modelfile (default: ./Modelfile)")
    cr.add_argument("-q", "--quantize", default=None, metavar="TYPE",
                    help="quantize an F16/BF16/F32 model's weights to TYPE (q4_K_M, q8_0, ...), as llama-quantize")
    cr.add_argument("--config", default=None, help="models.yaml path")
    cr.add_argument("--url", default=None, help="the running gateway asked whether the name is loaded")
    cr.set_defaults(func=_create)
    rm = sub.add_parser("rm", help="remove a pulled or created model and the files only it uses")
    rm.add_argument("id", help="the model's id (as `gateway ls` shows it)")
    rm.add_argument("--config", default=None, help="models.yaml path")
    rm.add_argument("--url", default=None, help="the running gateway asked whether it is loaded")
    rm.set_defaults(func=_rm)
    c = sub.add_parser("convert", help="convert a model's GGUF to another runtime's format (ORT GenAI, CoreML, "
                       "ExecuTorch, ...) in the cache")
    c.add_argument("--model", help="model id (models.yaml's default otherwise)")
    convs = converters()
    c.add_argument("--to", choices=tuple(convs), required=True, help="target format")
    c.add_argument("--precision", choices=tuple(dict.fromkeys(p for cv in convs.values() for p in cv.precisions)),
                   default="fp32", help="weights (default fp32; " + "; ".join(
                       f"{cv.target} uses {new} for {old}" for cv in convs.values()
                       for old, (new, _) in cv.substitutes.items()) + ")")
    for flag in dict.fromkeys(cv.variant_flag for cv in convs.values() if cv.variants):
        of = [cv for cv in convs.values() if cv.variant_flag == flag]
        c.add_argument(f"--{flag}", choices=tuple(dict.fromkeys(v for cv in of for v in cv.variants)), default=None,
                       help="; ".join(f"{cv.variant_help} (default {cv.variants[0]})" for cv in of))
    c.add_argument("--force", action="store_true", help="convert again even if the artifact exists")
    c.add_argument("--config", default=None, help="models.yaml path")
    c.set_defaults(func=_convert)
    w = sub.add_parser("worker", help="serve one model to gateways on other hosts (token required)")
    w.add_argument("--listen", required=True, metavar="HOST:PORT", help="address to listen on, e.g. 0.0.0.0:7070")
    w.add_argument("--token-file", required=True, help="file of accepted tokens, one per line (>= 16 characters)")
    w.add_argument("--model", help="model id (models.yaml's default otherwise)")
    add_setting_options(w, Settings, WORKER_SETTINGS)
    w.add_argument("--tls-cert", default=None, help="serve TLS with this certificate (PEM)")
    w.add_argument("--tls-key", default=None, help="the certificate's private key (PEM)")
    w.set_defaults(func=_worker)
    st = sub.add_parser("settings", help="the settings as the environment sets them (--markdown: the docs' tables)")
    st.add_argument("--markdown", nargs="?", const="reference", default=None, choices=("reference", "readme"),
                    help="print docs/configuration.md's tables (readme: the README's) as Markdown")
    st.add_argument("--write", nargs="+", default=None, metavar="FILE",
                    help="rewrite the generated tables in these Markdown files (README.md docs/configuration.md)")
    st.set_defaults(func=_settings)
    from gateway.bench import add_parser as add_bench
    from gateway.check_cli import add_parser as add_check
    from gateway.host.devices import add_parser as add_devices
    from gateway.parity.cli import add_parser as add_parity

    add_bench(sub)
    add_check(sub)
    add_devices(sub)
    add_parity(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        # First: the runtimes they register add engines to --engine and targets to `convert --to`.
        load_plugins(Settings.read("plugins"))
    except SettingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    try:
        Settings.from_env()  # a malformed variable is said before any work
        return int(args.func(args))
    except SettingError as exc:  # a malformed GATEWAY_* variable: said as such, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
