"""`buildvault serve` flags: generated from Settings, precedence flags > env > file > defaults;
`buildvault --version`."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from buildvault import cli
from buildvault.config import ConfigError, Settings, parse_size


def parse(argv, env=None):
    args = cli.build_parser().parse_args(["serve", *argv])
    return cli.settings_from_args(args, env or {})


PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_every_setting_has_a_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(["serve", "--help"])
    assert exit_info.value.code == 0
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", capsys.readouterr().out))
    for f in Settings.fields():
        assert "--" + f.name.replace("_", "-") in flags
    assert "--config" in flags


def test_version_is_the_project_version(capsys):
    expected = tomllib.loads(PYPROJECT.read_text())["project"]["version"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"buildvault {expected}\n"


def test_installed_console_script_prints_the_version():
    expected = tomllib.loads(PYPROJECT.read_text())["project"]["version"]
    # The console script installed beside this interpreter (the venv's), not a stray one on PATH.
    script = shutil.which("buildvault", path=str(Path(sys.executable).parent))
    assert script, f"no buildvault console script next to {sys.executable}; run scripts/setup-venv.sh"
    proc = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60, check=False)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"buildvault {expected}\n", "")


def test_defaults(tmp_path):
    settings = parse(["--dir", str(tmp_path)])
    assert settings.dir == tmp_path
    assert settings.grpc_address == Settings.__dataclass_fields__["grpc_address"].default
    assert settings.max_size == parse_size("10GiB")


def test_flags_beat_env_beat_file(tmp_path):
    config = tmp_path / "bv.toml"
    config.write_text('max_size = "1GiB"\ngrpc_address = "127.0.0.1:1111"\nlog_level = "warning"\ns3_bucket = "file"\n')
    env = {"BUILDVAULT_MAX_SIZE": "2GiB", "BUILDVAULT_GRPC_ADDRESS": "127.0.0.1:2222"}
    settings = parse(["--config", str(config), "--max-size", "3GiB", "--dir", str(tmp_path)], env)
    assert settings.max_size == 3 << 30  # flag
    assert settings.grpc_address == "127.0.0.1:2222"  # env over file
    assert settings.log_level == "warning"  # file over default
    assert settings.s3_bucket == "file"


def test_config_from_environment(tmp_path):
    config = tmp_path / "bv.toml"
    config.write_text('http_address = ""\n')
    assert parse(["--dir", str(tmp_path)], {"BUILDVAULT_CONFIG": str(config)}).http_address == ""


def test_bool_flags(tmp_path):
    assert parse(["--s3-read-only", "--dir", str(tmp_path)]).s3_read_only is True
    assert parse(["--s3-read-only", "false", "--dir", str(tmp_path)]).s3_read_only is False
    assert parse(["--dir", str(tmp_path)], {"BUILDVAULT_S3_READ_ONLY": "yes"}).s3_read_only is True


@pytest.mark.parametrize(
    "argv", [["--max-size", "lots"], ["--grpc-address", "noport"], ["--log-level", "loud"], ["--s3-addressing", "x"]]
)
def test_bad_values(argv, tmp_path):
    with pytest.raises(ConfigError):
        parse([*argv, "--dir", str(tmp_path)])


def test_main_exit_codes(tmp_path, capsys):
    assert cli.main(["serve", "--max-size", "lots", "--dir", str(tmp_path)]) == 2
    assert "max_size" in capsys.readouterr().err
    assert cli.main([]) == 2


def test_help_mentions_env_names(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "BUILDVAULT_MAX_SIZE" in out and "--grpc-address" in out
