"""Settings from one typed model: every variable name and default of before still works, and a
malformed value is one line that names it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.envconfig import SettingError, knobs
from engines.tuning import EngineTuning, engine_tuning
from gateway.settings import Settings

# The defaults and variable names these settings had as a hand-written dataclass and reader.
OLD_DEFAULTS = {
    "host": "127.0.0.1", "port": 8080, "model": None, "engine": "auto", "runtime": None, "device": None,
    "max_resident": 0, "memory_budget": None, "gpu_memory_budget": None, "memory_reserve": None,
    "keep_alive": 300.0, "keep_default": True, "parallel": None, "sequences": None, "threads": 0,
    "max_queue": 64, "preload": True, "max_queue_wait": 30.0, "prefix_cache": None, "pinned_host_cache": "auto",
    "prefill_budget": None, "drain_timeout": 30.0, "max_body": 4194304, "max_messages": 2048,
    "max_prompt_chars": 1000000, "log_level": "info", "api_key": None, "api_key_file": None,
    "metrics_api_key": None, "allowed_origins": (), "allowed_hosts": (), "functional_check": True,
    "isolate_check": True, "check_timeout": 300.0, "rank_by_speed": False, "workers": True,
    "worker_heartbeat_timeout": 3.0, "worker_step_timeout": 120.0, "worker_max_crashes": 3,
    "worker_crash_window": 300.0, "worker_plugins": (), "parity_reference": None, "parity_sample": 0.05,
    "parity_window": 20, "parity_queue": 16, "parity_enforce": False, "device_sampling": None, "cpu_variant": None,
    "crash_verdict_ttl": 1800.0, "worker_max_backoff": 30.0, "failover_budget": 2, "failover_wait": 120.0,
    "failover_replay": "exact", "responses_store": True, "responses_db": None, "responses_max": 10000,
    "responses_max_age_days": 30.0,
}
RENAMED_VARIABLES = {"max_resident": "GATEWAY_MAX_MODELS"}


def test_the_defaults_and_names_are_the_ones_of_before() -> None:
    s = Settings.from_env(env={})
    assert {name: getattr(s, name) for name in OLD_DEFAULTS} == OLD_DEFAULTS
    for name, k in knobs(Settings).items():
        assert k.env == RENAMED_VARIABLES.get(name, "GATEWAY_" + name.upper()), name


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


@pytest.mark.parametrize(("env", "message"), [
    ({"GATEWAY_PORT": "eighty"}, "GATEWAY_PORT must be a whole number 0-65535, not 'eighty'"),
    ({"GATEWAY_SEQUENCES": "300"}, "GATEWAY_SEQUENCES must be a whole number 1-256, not '300'"),
    ({"GATEWAY_MEMORY_BUDGET": "12X"}, "GATEWAY_MEMORY_BUDGET must be a size such as 4M, 512k or 2GiB, not '12X'"),
    ({"GATEWAY_KEEP_ALIVE": "5 minutes"}, "GATEWAY_KEEP_ALIVE must be seconds or a duration"),
    ({"GATEWAY_PRELOAD": "maybe"}, "GATEWAY_PRELOAD must be on or off"),
    ({"GATEWAY_ENGINE": "gpu"}, "GATEWAY_ENGINE must be auto, cpu, vulkan, cuda, metal, directml or coreml, not 'gpu'"),
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


