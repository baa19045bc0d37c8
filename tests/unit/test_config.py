from pathlib import Path

import pytest

from buildvault.config import ConfigError, load_settings, parse_size


@pytest.mark.parametrize(
    "text,expected",
    [
        ("0", 0),
        ("1048576", 1 << 20),
        ("512MiB", 512 << 20),
        ("512MB", 512 << 20),
        ("20GiB", 20 << 30),
        ("1.5G", 3 << 29),
        ("2k", 2048),
    ],
)
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "-1", "ten", "5XB", "1.2.3G"])
def test_bad_sizes_are_rejected(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_defaults_listen_on_loopback_and_store_in_the_user_cache_dir():
    s = load_settings({}, env={})
    assert s.grpc_address == "127.0.0.1:9092"
    assert s.http_address == "127.0.0.1:8080"
    assert "buildvault" in str(s.dir)
    assert s.max_size > 0
    assert s.s3_checksums == "when_required"


def test_flags_beat_environment_beat_file_beat_defaults(tmp_path):
    cfg = tmp_path / "buildvault.toml"
    cfg.write_text(
        'max_size = "1GiB"\ngrpc_address = "127.0.0.1:1000"\nhttp-address = "127.0.0.1:2000"\nlog_level = "debug"\n'
    )
    env = {"BUILDVAULT_GRPC_ADDRESS": "127.0.0.1:1001", "BUILDVAULT_HTTP_ADDRESS": "127.0.0.1:2001"}
    s = load_settings({"http_address": "127.0.0.1:2002", "dir": str(tmp_path)}, env=env, config_file=cfg)
    assert s.max_size == 1 << 30  # file
    assert s.log_level == "debug"  # file
    assert s.grpc_address == "127.0.0.1:1001"  # env over file
    assert s.http_address == "127.0.0.1:2002"  # flag over env
    assert s.dir == Path(tmp_path)


def test_config_file_from_environment(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('s3_bucket = "cache"\ns3_read_only = true\n')
    s = load_settings({}, env={"BUILDVAULT_CONFIG": str(cfg)})
    assert s.s3_bucket == "cache" and s.s3_read_only is True


@pytest.mark.parametrize(
    "flags,message",
    [
        ({"max_size": "lots"}, "max_size"),
        ({"grpc_address": "nohost"}, "grpc_address"),
        ({"log_level": "loud"}, "log_level"),
        ({"s3_read_only": "perhaps"}, "s3_read_only"),
        ({"s3_checksums": "always"}, "s3_checksums"),
    ],
)
def test_bad_values_name_the_setting(flags, message):
    with pytest.raises(ConfigError, match=message):
        load_settings(flags, env={})


def test_unknown_file_keys_are_errors(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("max_sise = 5\n")
    with pytest.raises(ConfigError, match="max_sise"):
        load_settings({}, env={}, config_file=cfg)
