"""``python -m kvlink.bootstrap`` as a real subprocess, and the configuration it refuses."""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from kvlink.bootstrap import BootstrapClient, BootstrapConfig, BootstrapConfigError, Unauthorized
from kvlink.bootstrap.cli import add_parser

REPO = pathlib.Path(__file__).resolve().parents[2]


def spawn(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-m", "kvlink.bootstrap", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def test_standalone_server_serves_and_stops_on_sigterm(tmp_path, make_registration):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    proc = spawn("--host", "127.0.0.1", "--port", "0", "--token-file", str(token_file), "--log-level", "WARNING")
    try:
        line = proc.stdout.readline()
        assert line.startswith("kvlink bootstrap listening on http://127.0.0.1:"), (line, proc.stderr.read())
        url = line.rsplit(" ", 1)[1].strip()
        with BootstrapClient(url, token="s3cret-token", timeout_s=5.0) as cli:
            cli.register_engine(make_registration("P"), lease_s=30.0)
            cli.publish("P", "r", [[1, 2]], 32, lease_s=30.0, transfer_id="t")
            assert cli.lookup_transfer("t").block_ids == [[1, 2]]
        with BootstrapClient(url, timeout_s=5.0) as anonymous:
            with pytest.raises(Unauthorized):
                anonymous.get_engine("P")
            assert anonymous.health().engines == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_standalone_refuses_public_host_without_token():
    proc = spawn("--host", "0.0.0.0", "--port", "0")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "without a token" in err and "allow_insecure" in err


def test_standalone_refuses_an_empty_token_file(tmp_path):
    empty = tmp_path / "token"
    empty.write_text("  \n")
    proc = spawn("--token-file", str(empty))
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "empty" in err


@pytest.mark.parametrize("args, says", [
    (("--token-file", "BINARY"), "is not UTF-8 text"),  # was a traceback (UnicodeDecodeError)
    (("--log-level", "bogus"), "invalid choice: 'BOGUS'"),  # was a traceback (logging's ValueError)
])
def test_standalone_refuses_a_bad_file_or_level_with_a_message(tmp_path, args, says):
    binary = tmp_path / "token"
    binary.write_bytes(b"\xff\xfe")
    proc = spawn(*(str(binary) if a == "BINARY" else a for a in args))
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and says in err and "Traceback" not in err


@pytest.mark.parametrize("level", ["warn", "Fatal", "notset", "debug"])
def test_every_command_takes_loggings_level_names_in_any_case(level):
    from kvlink.cli import build_parser

    for argv in (["--log-level", level, "bench"], ["bootstrap", "--log-level", level],
                 ["proxy", "--log-level", level, "--prefill", "http://a", "--decode", "http://b"]):
        args = build_parser().parse_args(argv)
        assert args.log_level == level.upper()


@pytest.mark.parametrize("flag", ["--max-requests-per-engine", "--max-ranks-per-engine", "--max-connections"])
def test_standalone_refuses_a_zero_cap_naming_it(flag):
    proc = spawn(flag, "0")
    _, err = proc.communicate(timeout=30)
    name = flag.removeprefix("--").replace("-", "_")
    assert proc.returncode == 2 and f"{name} must be at least 1" in err


def test_add_parser_wires_a_subcommand():
    parser = argparse.ArgumentParser(prog="kvlink")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bootstrap", "--port", "1234", "--allow-insecure", "--max-ranks-per-engine", "8"])
    assert (args.command, args.port, args.allow_insecure, args.token_file) == ("bootstrap", 1234, True, None)
    assert (args.max_ranks_per_engine, parser.parse_args(["bootstrap"]).max_ranks_per_engine) == (8, 4096)
    assert parser.parse_args(["bootstrap", "--max-connections", "64"]).max_connections == 64
    assert parser.parse_args(["bootstrap"]).max_connections == BootstrapConfig().max_connections
    assert callable(args.func)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"host": "0.0.0.0"}, "host"),
        ({"host": "10.1.2.3"}, "host"),
        ({"token": ""}, "token"),
        ({"token": " padded "}, "token"),
        ({"token": "secret-é"}, "token"),  # the client sends latin-1, the server compares UTF-8: never equal
        ({"token": "secret-中"}, "token"),  # the client could not send it at all
        ({"port": 70000}, "port"),
        ({"max_wait_s": 0}, "max_wait_s"),
        ({"max_wait_s": float("inf")}, "max_wait_s"),
        ({"default_request_lease_s": 900.0}, "default_request_lease_s"),
        ({"max_lookup_ids": 0}, "max_lookup_ids"),
        ({"max_body_bytes": 0}, "max_body_bytes"),
        ({"max_engines": 0}, "max_engines"),
        ({"max_requests_per_engine": 0}, "max_requests_per_engine"),
        ({"max_ranks_per_engine": 0}, "max_ranks_per_engine"),
        ({"max_connections": 0}, "max_connections"),
    ],
)
def test_config_is_validated(kwargs, field):
    with pytest.raises(BootstrapConfigError) as err:
        BootstrapConfig(**kwargs)
    assert err.value.field == field
    assert isinstance(err.value, ValueError)


def test_config_accepts_safe_setups(tmp_path):
    assert BootstrapConfig(host="::1").host == "::1"
    assert BootstrapConfig(host="localhost").host == "localhost"
    assert BootstrapConfig(host="0.0.0.0", token="t").token == "t"
    assert BootstrapConfig(host="0.0.0.0", allow_insecure=True).allow_insecure
    assert "t0ken" not in repr(BootstrapConfig(token="t0ken"))
    token_file = tmp_path / "tok"
    token_file.write_text("abc\n")
    assert BootstrapConfig.with_token_file(token_file, host="0.0.0.0").token == "abc"
    with pytest.raises(BootstrapConfigError):
        BootstrapConfig.with_token_file(tmp_path / "missing")
    with pytest.raises(Exception):  # frozen
        BootstrapConfig().port = 1  # type: ignore[misc]
