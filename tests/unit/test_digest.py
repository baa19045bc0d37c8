import hashlib
import os
from pathlib import Path

import blake3
import pytest

from buildvault.digest import (
    Digest,
    DigestFunction,
    InvalidDigest,
    file_matches,
    parse_read_resource,
    parse_write_resource,
    verify_instance_name,
)

H = "ab" * 32
UUID = "2d4a1a3e-1111-4222-8333-123456789abc"


def test_digest_of_matches_hashlib_and_blake3():
    assert Digest.of(b"hello").hash == hashlib.sha256(b"hello").hexdigest()
    assert Digest.of(b"hello", DigestFunction.BLAKE3).hash == blake3.blake3(b"hello").hexdigest()
    assert Digest.of(b"hello").size_bytes == 5


def test_the_digest_function_is_part_of_the_storage_key():
    sha = Digest(H, 3, DigestFunction.SHA256)
    b3 = Digest(H, 3, DigestFunction.BLAKE3)
    assert sha.key != b3.key
    assert sha != b3


@pytest.mark.parametrize("bad", ["", "ab", H.upper(), H[:-1] + "g", H + "a", " " + H[1:]])
def test_malformed_hashes_are_rejected(bad):
    with pytest.raises(InvalidDigest):
        Digest.parse(bad, 1)


def test_negative_size_is_rejected():
    with pytest.raises(InvalidDigest):
        Digest.parse(H, -1)


def test_wire_numbers_follow_the_spec():
    assert DigestFunction.from_wire(0) is DigestFunction.SHA256
    assert DigestFunction.from_wire(1) is DigestFunction.SHA256
    assert DigestFunction.from_wire(9) is DigestFunction.BLAKE3
    for unsupported in (2, 3, 4, 5, 6, 7, 8, 99):
        with pytest.raises(InvalidDigest):
            DigestFunction.from_wire(unsupported)


def test_read_resource_names():
    r = parse_read_resource(f"blobs/{H}/42")
    assert (r.instance_name, r.digest, r.compressor) == ("", Digest(H, 42), None)
    r = parse_read_resource(f"team/main/blobs/{H}/42/some/metadata")
    assert r.instance_name == "team/main" and r.digest.size_bytes == 42
    r = parse_read_resource(f"x/blobs/blake3/{H}/7")
    assert r.digest.function is DigestFunction.BLAKE3
    r = parse_read_resource(f"compressed-blobs/zstd/{H}/0")
    assert r.compressor == "zstd" and r.digest == Digest(H, 0)


def test_write_resource_names():
    r = parse_write_resource(f"inst/uploads/{UUID}/blobs/{H}/10")
    assert (r.instance_name, r.upload_id, r.digest.size_bytes) == ("inst", UUID, 10)
    r = parse_write_resource(f"uploads/{UUID}/compressed-blobs/zstd/blake3/{H}/10")
    assert r.compressor == "zstd" and r.digest.function is DigestFunction.BLAKE3


@pytest.mark.parametrize(
    "name",
    [
        "",
        f"/blobs/{H}/1",
        f"../blobs/{H}/1",
        f"a/../blobs/{H}/1",
        f"a//b/blobs/{H}/1",
        f"./blobs/{H}/1",
        f"blobs/{H}",
        f"blobs/{H}/-1",
        f"blobs/{H}/01",
        f"blobs/{H}/1e3",
        f"blobs/{H}/99999999999999999999",
        f"blobs/{H.upper()}/1",
        f"blobs/sha1/{H}/1",
        f"compressed-blobs/gzip/{H}/1",
        f"compressed-blobs/{H}/1",
        f"a b/blobs/{H}/1",
        "x" * 5000 + f"/blobs/{H}/1",
        f"uploads/{UUID}/blobs/{H}/1",  # an upload name is not a read name
        "nothing/here",
    ],
)
def test_hostile_or_malformed_read_names_are_rejected(name):
    with pytest.raises(InvalidDigest):
        parse_read_resource(name)


@pytest.mark.parametrize(
    "name",
    [
        f"blobs/{H}/1",
        f"uploads/blobs/{H}/1",
        f"uploads/../blobs/{H}/1",
        f"uploads/{UUID}/{H}/1",
        f"../uploads/{UUID}/blobs/{H}/1",
    ],
)
def test_malformed_write_names_are_rejected(name):
    with pytest.raises(InvalidDigest):
        parse_write_resource(name)


@pytest.mark.parametrize("name", ["", "main", "team/main", "a-b_c.d/e"])
def test_plain_instance_names_are_accepted(name):
    assert verify_instance_name(name) == name


@pytest.mark.parametrize("name", ["/abs", "a/", "..", "a/../b", "blobs", "a/uploads", "a\\b", "x" * 300, "a\0b"])
def test_instance_names_that_could_escape_or_confuse_are_rejected(name):
    with pytest.raises(InvalidDigest):
        verify_instance_name(name)


def test_bulk_hash_check_agrees_with_the_single_one():
    from buildvault.digest import all_hashes, is_hash

    good = [H, "0" * 64, Digest.of(b"x").hash]
    assert all_hashes(good) and all(map(is_hash, good))
    for bad in (H.upper(), H[:-1], H + "0", "g" * 64, "é" * 64):
        assert not is_hash(bad)
        assert not all_hashes(good + [bad])
    # lengths that add up right but are split wrongly are still caught
    assert not all_hashes([H[:-1], H + "a"])


@pytest.mark.parametrize("function", list(DigestFunction))
@pytest.mark.parametrize("size", [0, 1, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, (3 << 20) + 5])
def test_file_matches_only_the_exact_content(tmp_path: Path, function: DigestFunction, size: int) -> None:
    """Sizes around the one-read limit (1 MiB): the file is the blob; one byte more, one byte
    less, or one byte changed is not."""
    data = os.urandom(size)
    digest = Digest.of(data, function)

    def matches(content: bytes) -> bool:
        path = tmp_path / "blob"
        path.write_bytes(content)
        fd = os.open(path, os.O_RDONLY)
        try:
            return file_matches(fd, digest)
        finally:
            os.close(fd)

    assert matches(data)
    assert not matches(data + b"x")
    if size:
        assert not matches(data[:-1])
        assert not matches(data[:-1] + bytes([data[-1] ^ 1]))
