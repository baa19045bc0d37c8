"""buildvault.compression: the one zstd decoder both protocols use (frames, limits, bad input)."""

from __future__ import annotations

import os

import pytest
import zstandard

from buildvault.compression import (
    FRAME_HEADER_MAX,
    OUTPUT_CHUNK_SIZE,
    CompressionError,
    Reason,
    ZstdDecoder,
    frame_content_size,
    zstd_compress,
    zstd_compress_stream,
    zstd_decompress,
    zstd_decompress_stream,
    zstd_decompress_whole,
)

MiB = 1 << 20


async def pieces(data: bytes, size: int):
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def collect(chunks) -> bytes:
    return b"".join([chunk async for chunk in chunks])


def frames(*parts: bytes, content_size: bool = True) -> bytes:
    compressor = zstandard.ZstdCompressor(write_content_size=content_size)
    return b"".join(compressor.compress(part) for part in parts)


TEXT = b"".join(b"line %d of some compressible text\n" % i for i in range(50_000))  # ~1.7 MB


# -- whole payloads -----------------------------------------------------------------------------


def test_round_trip_whole():
    assert zstd_decompress(zstd_compress(TEXT), len(TEXT)) == TEXT


@pytest.mark.parametrize("content_size", [True, False])
def test_several_frames_decode_as_their_concatenation(content_size):
    parts = [os.urandom(1000), b"", b"z" * 300_000, TEXT[:5000]]
    payload = frames(*parts, content_size=content_size)
    assert zstd_decompress(payload, sum(map(len, parts))) == b"".join(parts)


def test_empty_payload_is_empty():
    assert zstd_decompress(b"", 0) == b""
    assert zstd_decompress(zstd_compress(b""), 0) == b""


@pytest.mark.parametrize("cut", [1, 5, 20, 1000])
def test_truncated_payload(cut):
    payload = zstd_compress(TEXT)[:-cut]
    with pytest.raises(CompressionError) as e:
        zstd_decompress(payload, len(TEXT))
    assert e.value.reason is Reason.TRUNCATED


def test_truncated_second_frame():
    payload = frames(b"first frame", TEXT)[:-7]
    with pytest.raises(CompressionError) as e:
        zstd_decompress(payload, 100 + len(TEXT))
    assert e.value.reason is Reason.TRUNCATED


@pytest.mark.parametrize(
    "payload",
    [
        b"not zstd at all" * 10,
        zstd_compress(b"a valid frame") + b"then trailing garbage",
        b"\x28\xb5\x2f\xfd" + bytes(range(7, 207)),  # the zstd magic number, then a bad header and blocks
    ],
    ids=["garbage", "trailing-garbage", "magic-then-noise"],
)
def test_malformed_payload(payload):
    with pytest.raises(CompressionError) as e:
        zstd_decompress(payload, 1 << 20)
    assert e.value.reason is Reason.MALFORMED


def test_output_past_the_declared_size():
    with pytest.raises(CompressionError) as e:
        zstd_decompress(zstd_compress(TEXT), len(TEXT) - 1)
    assert e.value.reason is Reason.OVER_DECLARED_SIZE and e.value.limit == len(TEXT) - 1


def test_output_past_a_server_limit_is_too_large():
    with pytest.raises(CompressionError) as e:
        zstd_decompress(zstd_compress(TEXT), 1000, declared=False)
    assert e.value.reason is Reason.TOO_LARGE and e.value.limit == 1000


async def test_whole_in_a_thread_or_not_gives_the_same_answer():
    small = b"small " * 10
    assert await zstd_decompress_whole(zstd_compress(small), len(small)) == small  # decoded in place
    assert await zstd_decompress_whole(zstd_compress(TEXT), len(TEXT)) == TEXT  # in a worker thread
    with pytest.raises(CompressionError) as e:
        await zstd_decompress_whole(zstd_compress(TEXT)[:-3], len(TEXT))
    assert e.value.reason is Reason.TRUNCATED


# -- the decoder's bounds ---------------------------------------------------------------------------


def test_a_bomb_is_refused_once_past_the_limit_not_decoded_whole():
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\0" * (512 * MiB))
    assert len(bomb) < 64 << 10
    decoder = ZstdDecoder(4 * MiB)
    pos, steps = 0, 0
    with pytest.raises(CompressionError) as e:
        while True:
            out, pos = decoder.step(bomb, pos)
            steps += 1
            assert len(out) <= OUTPUT_CHUNK_SIZE + 40 * MiB  # one step: about `want`, plus one input slice
    assert e.value.reason is Reason.OVER_DECLARED_SIZE
    assert decoder.total <= 4 * MiB  # nothing past the limit was handed out
    assert pos < len(bomb)  # refused before the input was used up


def test_step_hands_out_about_want_bytes_at_a_time():
    payload = zstd_compress(TEXT)
    decoder = ZstdDecoder(len(TEXT))
    pos, outputs = 0, []
    while pos < len(payload):
        out, pos = decoder.step(payload, pos, want=64 << 10)
        outputs.append(out)
    decoder.finish()
    assert b"".join(outputs) == TEXT
    assert len(outputs) > 10 and max(map(len, outputs)) < (64 << 10) + 2 * (128 << 10)
    assert decoder.total == len(TEXT)


# -- streams ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("piece", [1, 7, 4096, 300_000, 10 * MiB])
async def test_stream_of_several_frames_in_any_pieces(piece):
    parts = [TEXT[:100_000], os.urandom(20_000), TEXT]
    payload = frames(*parts, content_size=False)
    if piece == 1:
        payload = frames(b"tiny", b" frames", content_size=False)
        parts = [b"tiny", b" frames"]
    out = await collect(zstd_decompress_stream(pieces(payload, piece), sum(map(len, parts))))
    assert out == b"".join(parts)


async def test_stream_truncated_between_pieces():
    payload = zstd_compress(TEXT)[:-1]
    with pytest.raises(CompressionError) as e:
        await collect(zstd_decompress_stream(pieces(payload, 9999), len(TEXT)))
    assert e.value.reason is Reason.TRUNCATED


async def test_stream_ending_on_a_frame_boundary_is_complete():
    payload = frames(b"one", b"two")
    assert await collect(zstd_decompress_stream(pieces(payload, len(frames(b"one"))), 6)) == b"onetwo"


async def test_stream_refuses_output_past_the_limit_as_it_appears():
    received = []

    async def watch():
        async for chunk in zstd_decompress_stream(pieces(zstd_compress(TEXT), 1 << 16), 100_000):
            received.append(chunk)

    with pytest.raises(CompressionError) as e:
        await watch()
    assert e.value.reason is Reason.OVER_DECLARED_SIZE
    assert sum(map(len, received)) <= 100_000


async def test_stream_garbage():
    with pytest.raises(CompressionError) as e:
        await collect(zstd_decompress_stream(pieces(b"\0" * 5000, 100), 10_000))
    assert e.value.reason is Reason.MALFORMED


async def test_compress_stream_is_one_frame_declaring_its_size():
    payload = await collect(zstd_compress_stream(pieces(TEXT, 100_000), len(TEXT)))
    assert frame_content_size(payload[:FRAME_HEADER_MAX]) == len(TEXT)
    assert zstd_decompress(payload, len(TEXT)) == TEXT


def test_frame_content_size():
    assert frame_content_size(zstd_compress(b"x" * 1234)[:FRAME_HEADER_MAX]) == 1234
    assert frame_content_size(frames(b"x" * 1234, content_size=False)[:FRAME_HEADER_MAX]) is None
    assert frame_content_size(b"definitely not zstd") is None
    assert frame_content_size(b"") is None
