"""`buildvault asset fetch|push`: the Remote Asset API outside Bazel (CMake's third-party
sources, a mirror of an internal tarball).

    buildvault asset fetch URL... --sha256 HEX [-o FILE]    the cache first, else the server
                                                          downloads it (its rules), else an error
    buildvault asset push FILE --uri URL [--uri URL...]     a writer stores FILE under the URLs
    buildvault asset pin URL... --sha256 HEX --label LABEL  a writer keeps it (a golden pin:
                                                          never evicted, never removed by gc)
    buildvault asset pin URL... --directory --label LABEL   the same for a directory pushed by
                                                          PushDirectory (its whole tree)
    buildvault asset unpin LABEL | pins                     remove a pin | list them

The server comes from `--remote` or BUILDVAULT_REMOTE (grpc://host:port), credentials from
BUILDVAULT_TOKEN / BUILDVAULT_TOKEN_FILE, TLS from BUILDVAULT_TLS_CA (client/remote.py). The
file is streamed to disk and verified against the sha256 before it is renamed into place; a
miss or a mismatch exits 1 with the reason on stderr (2: usage).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import sys
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from urllib.parse import urlsplit

import grpc

from buildvault import pins
from buildvault.assets.index import key_digest, sri_key, uri_key
from buildvault.assets.request import SRI_QUALIFIER, Checksum
from buildvault.client.pin_index import read_index, remove_asset_pin, set_asset_pin
from buildvault.client.remote import Remote, RemoteError, TokenSource, open_channel
from buildvault.digest import Digest, DigestFunction
from buildvault.remote_apis import bs_grpc, bs_pb2, ra_grpc, ra_pb2, re_grpc, re_pb2

__all__ = ["add_asset_parser", "main_asset"]

OK, FAILED, USAGE = 0, 1, 2
CHUNK = 1 << 20


def add_asset_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = commands.add_parser("asset", help="fetch or push external downloads through the cache (Remote Asset)")
    sub = parser.add_subparsers(dest="asset_command", metavar="ACTION", required=True)
    for name, text in (("fetch", "fetch URL into FILE: from the cache, else through the server"),
                       ("push", "store FILE under the URLs (needs write permission)"),
                       ("pin", "fetch it (cache first; a pushed directory with --directory), then pin it as "
                               "LABEL: kept through eviction and gc"),
                       ("unpin", "remove asset pin LABEL"),
                       ("pins", "list asset pins: LABEL, HASH/SIZE (and `directory` for a directory)")):  # fmt: skip
        p = sub.add_parser(name, help=text)
        p.add_argument("--remote", default=None, help="grpc://host:port (default: BUILDVAULT_REMOTE)")
        p.add_argument("--instance", default=None, help="REAPI instance name (default: BUILDVAULT_INSTANCE)")
        p.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS", help="for the whole call")
        if name in ("fetch", "pin"):
            p.add_argument("urls", nargs="+", metavar="URL", help="the origin URL and any mirrors")
        if name == "fetch":
            p.add_argument("--sha256", required=True, metavar="HEX", help="the content's SHA-256")
            p.add_argument("-o", "--output", default=None, metavar="FILE", help="default: the URL's file name")
        elif name == "pin":
            what = p.add_mutually_exclusive_group(required=True)
            what.add_argument("--sha256", metavar="HEX", help="a blob: the content's SHA-256")
            what.add_argument("--directory", action="store_true",
                              help="a directory recorded by PushDirectory (FetchDirectory of the URLs)")  # fmt: skip
            p.add_argument("--label", required=True, metavar="LABEL", help="the pin's name")
        elif name == "unpin":
            p.add_argument("label", metavar="LABEL")
        elif name == "push":
            p.add_argument("file", metavar="FILE")
            p.add_argument("--uri", action="append", required=True, metavar="URL", help="a URL it is known by")


def _say(text: str) -> None:
    print(f"buildvault asset: {text}", file=sys.stderr)


def _sri(raw: bytes) -> str:
    return Checksum("sha256", raw).sri


class _Client:
    def __init__(self, remote: str, instance: str, timeout: float) -> None:
        self.channel = open_channel(remote)
        self.tokens = TokenSource()
        self.instance = instance
        self.timeout = timeout
        self.fetch = ra_grpc.FetchStub(self.channel)
        self.push = ra_grpc.PushStub(self.channel)
        self.bytestream = bs_grpc.ByteStreamStub(self.channel)
        self.cas = re_grpc.ContentAddressableStorageStub(self.channel)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return self.tokens.metadata()

    def close(self) -> None:
        self.channel.close()

    def _prefix(self) -> str:
        return f"{self.instance}/" if self.instance else ""

    def read_to(self, digest: re_pb2.Digest, out: Path, expected: bytes) -> None:
        """Stream the blob into a temp file beside `out`, verify, rename into place."""
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
        try:
            hasher = hashlib.sha256()
            with os.fdopen(fd, "wb") as f:
                request = bs_pb2.ReadRequest(resource_name=f"{self._prefix()}blobs/{digest.hash}/{digest.size_bytes}")
                for response in self.bytestream.Read(request, timeout=self.timeout, metadata=self.metadata):
                    hasher.update(response.data)
                    f.write(response.data)
            if hasher.digest() != expected:
                raise RemoteError(f"the server's blob does not match {_sri(expected)}")
            os.replace(temp, out)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise

    def directories(self, root: re_pb2.Digest) -> list[re_pb2.Directory]:
        """Every Directory of the tree under `root`, the root first (GetTree, page by page)."""
        out: list[re_pb2.Directory] = []
        token = ""
        while True:
            request = re_pb2.GetTreeRequest(instance_name=self.instance, root_digest=root, page_token=token)
            for page in self.cas.GetTree(request, timeout=self.timeout, metadata=self.metadata):
                out.extend(page.directories)
                token = page.next_page_token
            if not token:
                break
        if not out:
            raise RemoteError(f"GetTree of {root.hash}/{root.size_bytes} answered no directory")
        return out

    def upload(self, path: Path) -> Digest:
        hasher = hashlib.sha256()
        size = 0
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(CHUNK), b""):
                hasher.update(block)
                size += len(block)
        digest = Digest.parse(hasher.hexdigest(), size)
        proto = digest.to_proto(re_pb2.Digest)
        found = self.cas.FindMissingBlobs(re_pb2.FindMissingBlobsRequest(instance_name=self.instance,
                                                                         blob_digests=[proto]),
                                          timeout=self.timeout, metadata=self.metadata)  # fmt: skip
        if not found.missing_blob_digests:
            return digest
        name = f"{self._prefix()}uploads/{uuid.uuid4()}/blobs/{digest.hash}/{digest.size_bytes}"

        def requests() -> Iterator[bs_pb2.WriteRequest]:
            offset = 0
            with open(path, "rb") as f:
                while True:
                    block = f.read(CHUNK)
                    last = offset + len(block) >= size
                    yield bs_pb2.WriteRequest(resource_name=name if offset == 0 else "", write_offset=offset,
                                              finish_write=last, data=block)  # fmt: skip
                    offset += len(block)
                    if last:
                        return

        try:
            self.bytestream.Write(requests(), timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise
        return digest


def _sha256(text: str) -> bytes | None:
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        _say(f"--sha256 {text!r}: want 64 hex digits")
        return None
    return raw


def _fetch_blob(client: _Client, args: argparse.Namespace, raw: bytes) -> ra_pb2.FetchBlobResponse:
    """FetchBlob of `args.urls` with their sha256 `raw` as the checksum qualifier."""
    request = ra_pb2.FetchBlobRequest(
        instance_name=client.instance,
        uris=args.urls,
        qualifiers=[ra_pb2.Qualifier(name=SRI_QUALIFIER, value=_sri(raw))],
    )
    response: ra_pb2.FetchBlobResponse = client.fetch.FetchBlob(
        request, timeout=args.timeout, metadata=client.metadata
    )
    return response


def _fetch(client: _Client, args: argparse.Namespace) -> int:
    raw = _sha256(args.sha256)
    if raw is None:
        return USAGE
    output = Path(args.output) if args.output else Path(Path(urlsplit(args.urls[0]).path).name or "download")
    if output.is_file():  # already here with the right content: nothing to do
        hasher = hashlib.sha256()
        with open(output, "rb") as f:
            for block in iter(lambda: f.read(CHUNK), b""):
                hasher.update(block)
        if hasher.digest() == raw:
            return OK
    answer = _fetch_blob(client, args, raw)
    client.read_to(answer.blob_digest, output, raw)
    print(output)
    return OK


def _push(client: _Client, args: argparse.Namespace) -> int:
    path = Path(args.file)
    if not path.is_file():
        _say(f"{path}: not a file")
        return USAGE
    digest = client.upload(path)
    request = ra_pb2.PushBlobRequest(
        instance_name=client.instance,
        uris=args.uri,
        qualifiers=[ra_pb2.Qualifier(name=SRI_QUALIFIER, value=_sri(bytes.fromhex(digest.hash)))],
        blob_digest=digest.to_proto(re_pb2.Digest),
    )
    client.push.PushBlob(request, timeout=args.timeout, metadata=client.metadata)
    print(f"{digest.hash} {digest.size_bytes}")
    return OK


def _pin_remote(client: _Client, remote: str) -> Remote:
    return Remote(remote, client.instance, timeout=client.timeout, upload_timeout=client.timeout)


def _pin(client: _Client, args: argparse.Namespace, remote: str) -> int:
    """FetchBlob (a hit, or the server's download), then pin the blob and the index entries a
    fetch of it is answered from: its checksum's, and each URL's (without other qualifiers)."""
    if args.directory:
        return _pin_directory(client, args, remote)
    raw = _sha256(args.sha256)
    if raw is None:
        return USAGE
    answer = _fetch_blob(client, args, raw)
    content = Digest.from_proto(answer.blob_digest)
    keys = [sri_key(Checksum("sha256", raw))] + [uri_key(url, []) for url in args.urls]
    with contextlib.closing(_pin_remote(client, remote)) as pins_remote:
        set_asset_pin(pins_remote, args.label, content, [key_digest(k, DigestFunction.SHA256) for k in keys])
    print(f"[buildvault] PINNED asset={args.urls[0]} blob={content.hash}/{content.size_bytes} pin={args.label}")
    return OK


def _pin_directory(client: _Client, args: argparse.Namespace, remote: str) -> int:
    """FetchDirectory (a hit: directories come from Push only), then pin its root Directory, a
    Tree of the whole tree (every Directory and file under it, as GetTree reads them) and the
    index entries FetchDirectory of each URL (without qualifiers) is answered from."""
    request = ra_pb2.FetchDirectoryRequest(instance_name=client.instance, uris=args.urls)
    answer = client.fetch.FetchDirectory(request, timeout=args.timeout, metadata=client.metadata)
    root = Digest.from_proto(answer.root_directory_digest)
    directories = client.directories(answer.root_directory_digest)
    tree = re_pb2.Tree(root=directories[0], children=directories[1:]).SerializeToString(deterministic=True)
    keys = [key_digest(uri_key(url, []), DigestFunction.SHA256) for url in args.urls]
    with contextlib.closing(_pin_remote(client, remote)) as pins_remote:
        set_asset_pin(pins_remote, args.label, root, keys, tree=tree)
    print(f"[buildvault] PINNED asset={args.urls[0]} directory={root.hash}/{root.size_bytes} "
          f"directories={len(directories)} pin={args.label}")  # fmt: skip
    return OK


def _unpin(client: _Client, args: argparse.Namespace, remote: str) -> int:
    with contextlib.closing(_pin_remote(client, remote)) as pins_remote:
        if not remove_asset_pin(pins_remote, args.label):
            _say(f"no asset pin {args.label}")
            return FAILED
    print(f"[buildvault] UNPINNED asset pin={args.label}")
    return OK


def _pins(client: _Client, args: argparse.Namespace, remote: str) -> int:
    with contextlib.closing(_pin_remote(client, remote)) as pins_remote:
        index = read_index(pins_remote)
    trees = pins.pinned_asset_trees(index)
    for label, blob in sorted(pins.pinned_assets(index).items()):
        kind = "\tdirectory" if label in trees else ""  # a directory's blob is its root Directory
        print(f"{label}\t{blob.hash}/{blob.size_bytes}{kind}")
    return OK


def main_asset(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    remote = args.remote or env.get("BUILDVAULT_REMOTE", "")
    if not remote:
        _say("no server: give --remote grpc://host:port or set BUILDVAULT_REMOTE")
        return USAGE
    instance = args.instance if args.instance is not None else env.get("BUILDVAULT_INSTANCE", "")
    try:
        client = _Client(remote, instance, args.timeout)
    except RemoteError as e:
        _say(str(e))
        return USAGE
    label = getattr(args, "label", None)
    if label is not None and not pins.valid_name(label):
        _say(f"label {label!r}: use letters, digits and _ . + - (not starting with . or -)")
        return USAGE
    try:
        if args.asset_command == "fetch":
            return _fetch(client, args)
        if args.asset_command == "push":
            return _push(client, args)
        return {"pin": _pin, "unpin": _unpin, "pins": _pins}[args.asset_command](client, args, remote)
    except grpc.RpcError as e:
        _say(f"{e.code().name}: {e.details()}")
        return FAILED
    except (RemoteError, OSError) as e:
        _say(str(e))
        return FAILED
    finally:
        client.close()
