"""Settings from one typed model: each setting's variable and flag give the same value, every
variable and flag name of before still works, and a malformed value is one line that names it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.envconfig import Knob, SettingError, knobs
from engines.tuning import EngineTuning, engine_tuning
from gateway.cli import build_parser, main
from gateway.settings import Settings
from gateway.settings_flags import given_settings

# The defaults and names these settings had as a hand-written dataclass, argparse parser and reader.
OLD_DEFAULTS = {
    "host": "127.0.0.1", "port": 8080, "model": None, "engine": "auto", "runtime": None, "device": None,
    "max_resident": 0, "memory_budget": None, "gpu_memory_budget": None, "memory_reserve": None,
    "keep_alive": 300.0, "keep_default": True, "parallel": None, "sequences": None, "threads": 0,
    "max_queue": 64, "preload": True, "max_queue_wait": 30.0, "prefix_cache": None, "pinned_host_cache": "auto",
    "prefill_budget": None, "drain_timeout": 30.0, "max_body": 4194304, "max_messages": 2048,
    "max_prompt_chars": 1000000, "log_level": "info", "api_key": None, "api_key_file": None,
    "metrics_api_key": None, "allowed_origins": (), "allowed_hosts": (), "functional_check": True, "check_models": True,
    "isolate_check": True, "check_timeout": 300.0, "rank_by_speed": False, "workers": True,
    "worker_heartbeat_timeout": 3.0, "worker_step_timeout": 120.0, "worker_max_crashes": 3,
    "worker_crash_window": 300.0, "worker_plugins": (), "plugins": (), "parity_reference": None, "parity_sample": 0.05,
    "parity_window": 20, "parity_queue": 16, "parity_enforce": False, "device_sampling": None, "cpu_variant": None,
    "crash_verdict_ttl": 1800.0, "worker_max_backoff": 30.0, "failover_budget": 2, "failover_wait": 120.0,
    "failover_replay": "exact", "responses_store": True, "responses_db": None, "responses_max": 10000,
    "responses_max_age_days": 30.0,
}
RENAMED_VARIABLES = {"max_resident": "GATEWAY_MAX_MODELS"}
OLD_FLAGS = {
    "--model": "model", "--engine": "engine", "--runtime": "runtime", "--device": "device",
    "--rank-by-speed": "rank_by_speed", "--no-check-models": "check_models", "--host": "host", "--port": "port", "--config": "config",
    "--max-models": "max_resident", "--memory-budget": "memory_budget", "--gpu-memory-budget": "gpu_memory_budget",
    "--memory-reserve": "memory_reserve", "--keep-alive": "keep_alive", "--unload-default": "keep_default",
    "--parallel": "parallel", "--sequences": "sequences", "--threads": "threads", "--api-key": "api_key",
    "--api-key-file": "api_key_file", "--metrics-api-key": "metrics_api_key", "--allowed-origins": "allowed_origins",
    "--allowed-hosts": "allowed_hosts", "--max-queue": "max_queue", "--max-queue-wait": "max_queue_wait",
    "--prefix-cache": "prefix_cache", "--prefill-budget": "prefill_budget", "--drain-timeout": "drain_timeout",
    "--max-body": "max_body", "--parity-reference": "parity_reference", "--parity-sample": "parity_sample",
    "--parity-window": "parity_window", "--parity-queue": "parity_queue", "--parity-enforce": "parity_enforce",
    "--image-fetch": "image_fetch",
}
# A well-formed text of each kind of setting, and what it means.
SAMPLES = {"int": "2", "float": "0.5", "size": "12G", "mib": "2G", "duration": "1h30m", "list": "a, b", "str": "x"}
FLAG_KNOBS = [k for k in knobs(Settings).values() if k.flag is not None]


def _sample(k: Knob) -> str:
    if k.kind == "choice":
        return k.choices[-1]
    if k.kind == "switch":
        return "0" if k.info.default else "1"
    return SAMPLES[k.kind]


def _from_flags(*argv: str) -> Settings:
    return Settings.from_env(env={}, **given_settings(build_parser().parse_args(["serve", *argv]), Settings))


def test_the_defaults_and_names_are_the_ones_of_before() -> None:
    s = Settings.from_env(env={})
    assert {name: getattr(s, name) for name in OLD_DEFAULTS} == OLD_DEFAULTS
    for name, k in knobs(Settings).items():
        assert k.env == RENAMED_VARIABLES.get(name, "GATEWAY_" + name.upper()), name
    assert {k.flag: k.name for k in FLAG_KNOBS} == OLD_FLAGS


@pytest.mark.parametrize("k", FLAG_KNOBS, ids=lambda k: k.flag)
def test_a_variable_and_its_flag_give_the_same_value(k: Knob) -> None:
    text = _sample(k)
    from_env = getattr(Settings.from_env(env={k.env: text}), k.name)
    from_flag = getattr(_from_flags(k.flag) if k.kind == "switch" else _from_flags(k.flag, text), k.name)
    assert from_env == from_flag != getattr(Settings.from_env(env={}), k.name), (k.name, from_env, from_flag)


@pytest.mark.parametrize(("env", "want"), [
    ({"GATEWAY_MAX_MODELS": "3"}, {"max_resident": 3}),
    ({"GATEWAY_KEEP_DEFAULT": "0"}, {"keep_default": False}),
    ({"GATEWAY_MEMORY_BUDGET": "2MiB", "GATEWAY_MAX_BODY": "512k"}, {"memory_budget": 2 << 20, "max_body": 512 << 10}),
    ({"GATEWAY_PREFIX_CACHE": "2048"}, {"prefix_cache": 2048}),  # a bare number is MiB
    ({"GATEWAY_PREFIX_CACHE": "0"}, {"prefix_cache": 0}),
    ({"GATEWAY_KEEP_ALIVE": "-1"}, {"keep_alive": -1.0}),
    ({"GATEWAY_ALLOWED_ORIGINS": " https://a.example ,*"}, {"allowed_origins": ("https://a.example", "*")}),
    ({"GATEWAY_PINNED_HOST_CACHE": "yes", "GATEWAY_DEVICE_SAMPLING": "OFF"},
     {"pinned_host_cache": "on", "device_sampling": "off"}),
    ({"GATEWAY_PRELOAD": "false", "GATEWAY_WORKERS": "no", "GATEWAY_RANK_BY_SPEED": "on"},
     {"preload": False, "workers": False, "rank_by_speed": True}),
    ({"GATEWAY_MODEL": "", "GATEWAY_PORT": ""}, {"model": None, "port": 8080}),  # empty: unset
])
def test_variables(env: dict[str, str], want: dict[str, object]) -> None:
    s = Settings.from_env(env=env)
    assert {name: getattr(s, name) for name in want} == want


def test_a_flag_wins_over_its_variable_and_none_is_not_given() -> None:
    env = {"GATEWAY_PORT": "9000", "GATEWAY_PARALLEL": "3"}
    assert Settings.from_env(env=env, port=9100, parallel=None).port == 9100
    assert Settings.from_env(env=env, port=9100, parallel=None).parallel == 3
    s = Settings.from_env(env={"GATEWAY_PORT": "9000"}, **given_settings(
        build_parser().parse_args(["serve", "--port", "9100", "--unload-default"]), Settings))
    assert (s.port, s.keep_default) == (9100, False)


@pytest.mark.parametrize(("env", "message"), [
    ({"GATEWAY_PORT": "eighty"}, "GATEWAY_PORT must be a whole number 0-65535, not 'eighty'"),
    ({"GATEWAY_SEQUENCES": "300"}, "GATEWAY_SEQUENCES must be a whole number 1-256, not '300'"),
    ({"GATEWAY_MEMORY_BUDGET": "12X"}, "GATEWAY_MEMORY_BUDGET must be a size such as 4M, 512k or 2GiB, not '12X'"),
    ({"GATEWAY_KEEP_ALIVE": "5 minutes"}, "GATEWAY_KEEP_ALIVE must be seconds or a duration"),
    ({"GATEWAY_PRELOAD": "maybe"}, "GATEWAY_PRELOAD must be on or off"),
    ({"GATEWAY_ENGINE": "gpu"}, "GATEWAY_ENGINE must be auto, cuda, metal, vulkan, directml, coreml or cpu, not 'gpu'"),
    ({"GATEWAY_FAILOVER_REPLAY": "slow"}, "GATEWAY_FAILOVER_REPLAY must be exact or fast, not 'slow'"),
    ({"GATEWAY_PARITY_SAMPLE": "2"}, "GATEWAY_PARITY_SAMPLE must be a number 0-1, not '2'"),
    ({"GATEWAY_MAX_MODELS": "-1"}, "GATEWAY_MAX_MODELS must be a whole number >= 0, not '-1'"),
])
def test_a_malformed_variable_is_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingError) as info:
        Settings.from_env(env=env)
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)


def test_a_malformed_value_from_python_names_the_setting() -> None:
    with pytest.raises(SettingError, match="^sequences must be a whole number 1-256, not 0$"):
        Settings.from_env(env={}, sequences=0)
    with pytest.raises(SettingError, match="unknown setting 'paralel'"):
        Settings.from_env(env={}, paralel=2)


@pytest.mark.parametrize(("argv", "message"), [
    (["--port", "eighty"], "argument --port: must be a whole number 0-65535, not 'eighty'"),
    (["--max-body", "4Q"], "argument --max-body: must be a size such as 4M, 512k or 2GiB, not '4Q'"),
    (["--sequences", "0"], "argument --sequences: must be a whole number 1-256, not '0'"),
    (["--engine", "gpu"], "argument --engine: must be auto, cuda, metal, vulkan, directml, coreml or cpu"),
])
def test_a_malformed_flag_is_named(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


@pytest.mark.parametrize(("var", "value"), [("GATEWAY_PORT", "eighty"), ("GATEWAY_WARMUP", "sometimes")])
def test_serve_says_a_malformed_variable_in_one_line(var: str, value: str, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(var, value)
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {var} must be ") and f"not {value!r}" in err and err.count("\n") == 1, err


def test_other_commands_say_a_malformed_variable_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GATEWAY_MAX_BODY", "lots")
    assert main(["models"]) == 2
    assert capsys.readouterr().err.startswith("error: GATEWAY_MAX_BODY must be a size")


def test_settings_are_frozen_and_copied_with_changes() -> None:
    s = Settings.from_env(env={})
    with pytest.raises(ValueError):
        s.port = 1  # type: ignore[misc]
    t = s.model_copy(update={"parallel": 1})
    assert (t.parallel, s.parallel) == (1, None) and t.port == s.port
    assert hash(s) == hash(Settings.from_env(env={}))
    assert "secret" not in repr(Settings.from_env(env={"GATEWAY_API_KEY": "secret"}))


def test_one_setting_read_alone(tmp_path: Path) -> None:
    from gateway.models.hub import user_models_dir

    assert Settings.read("models_dir", {"GATEWAY_MODELS_DIR": str(tmp_path)}) == str(tmp_path)
    assert Settings.read("models_dir", {}) is None
    assert user_models_dir() == Path(Settings.read("models_dir"))  # the test session sets it (conftest)
    with pytest.raises(SettingError, match="GATEWAY_MAX_QUEUE must be a whole number"):
        Settings.read("max_queue", {"GATEWAY_MAX_QUEUE": "many"})


def test_engine_tuning(monkeypatch: pytest.MonkeyPatch) -> None:
    assert engine_tuning({}) == EngineTuning()
    t = engine_tuning({"GATEWAY_SPLIT_MIXED": "1", "GATEWAY_PREFIX_FOLLOW": "off", "GATEWAY_TRIM_PAYBACK": "1e9",
                       "GATEWAY_GC_FREEZE": "0", "GATEWAY_LONG_PROMPT_TOKENS": "4096"})
    assert (t.split_mixed, t.prefix_follow, t.trim_payback, t.gc_freeze, t.long_prompt_tokens) == \
        ("on", False, 1e9, False, 4096)
    monkeypatch.setenv("GATEWAY_WARMUP", "off")
    assert engine_tuning().warmup == "off"  # read from the environment of now, not cached
    with pytest.raises(SettingError, match="^GATEWAY_LONG_PROMPT_SMS must be a whole number >= 0, not '-2'$"):
        engine_tuning({"GATEWAY_LONG_PROMPT_SMS": "-2"})


def test_the_settings_command_lists_values_and_hides_keys(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GATEWAY_API_KEY", "s3cret")
    monkeypatch.setenv("GATEWAY_MAX_MODELS", "4")
    assert main(["settings"]) == 0
    out = capsys.readouterr().out
    assert "s3cret" not in out and "(set)" in out
    assert any(line.split() == ["max_resident", "GATEWAY_MAX_MODELS", "4"] for line in out.splitlines())
