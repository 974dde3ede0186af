"""Images in chat messages: what a content part may point at, and the limits on it.

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR..."}}   always
    {"type": "image_url", "image_url": {"url": "file:///srv/media/cat.png"}}       only inside
                                                    --allowed-local-media-path (vLLM's flag)
    http(s) URLs are refused: this server fetches nothing from the network.

The parser (gateway/parsing.py) leaves IMAGE_MARK in the text where each part stood and keeps
its URL; `MediaPolicy.load` turns the URLs into the files' bytes, in order, checking the count
(--limit-mm-per-prompt) and each file's size. Whether the bytes are an image the model can
take is the tokenizer's check (services/tokenizer/images.py): it knows the model.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import json
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from pagemesh.common import cli_args
from pagemesh.gateway.errors import invalid

DEFAULT_IMAGES_PER_PROMPT = 8
DEFAULT_MAX_IMAGE_BYTES = 16 << 20


@dataclass(frozen=True)
class MediaPolicy:
    """The limits on a request's images and where local files may be read from (None: nowhere)."""

    images_per_prompt: int = DEFAULT_IMAGES_PER_PROMPT
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    allowed_local_media_path: Path | None = None

    def load(self, urls: tuple[str, ...], where: str = "messages") -> list[bytes]:
        """The files behind a request's image URLs, in order (400s name `where`)."""
        if len(urls) > self.images_per_prompt:
            raise invalid(
                f"{where}: {len(urls)} images; at most {self.images_per_prompt} per prompt (--limit-mm-per-prompt)",
                where,
            )
        return [self._one(url, f"{where}: image {i}", where) for i, url in enumerate(urls)]

    def _one(self, url: str, what: str, where: str) -> bytes:
        if url.startswith("data:"):
            data = _data_url(url, what, where)
        elif url.startswith("file:"):
            data = self._local_file(url, what, where)
        elif url.startswith(("http:", "https:")):
            raise invalid(f"{what}: http(s) URLs are not fetched by this server; send a data: URL", where)
        else:
            raise invalid(
                f"{what}: the url must be a data: URL (or a file: URL under --allowed-local-media-path)", where
            )
        if len(data) > self.max_image_bytes:
            raise invalid(f"{what}: {len(data)} bytes; at most {self.max_image_bytes} bytes per image", where)
        if not data:
            raise invalid(f"{what}: empty", where)
        return data

    def _local_file(self, url: str, what: str, where: str) -> bytes:
        root = self.allowed_local_media_path
        if root is None:
            raise invalid(
                f"{what}: file: URLs are refused unless the server runs with --allowed-local-media-path", where
            )
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise invalid(f"{what}: a file: URL names no host", where)
        path = Path(unquote(parsed.path)).resolve()
        if not path.is_relative_to(root):  # after resolving links and `..`: nothing outside the root
            raise invalid(f"{what}: the file is outside --allowed-local-media-path", where)
        if not path.is_file():
            raise invalid(f"{what}: no such file under --allowed-local-media-path", where)
        if path.stat().st_size > self.max_image_bytes:
            raise invalid(f"{what}: the file is larger than {self.max_image_bytes} bytes", where)
        return path.read_bytes()


def _data_url(url: str, what: str, where: str) -> bytes:
    head, comma, payload = url.partition(",")
    if not comma or not head.endswith(";base64"):
        raise invalid(f"{what}: a data: URL must be base64 (data:image/png;base64,...)", where)
    media_type = head[len("data:") : -len(";base64")]
    if media_type and not media_type.startswith("image/"):
        raise invalid(f"{what}: media type {media_type[:40]!r} is not an image", where)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"{what}: the data: URL's base64 is malformed", where) from None


def add_media_arguments(parser: argparse.ArgumentParser) -> None:
    """The image flags of `pagemesh gateway` and `pagemesh up`, spelled as vLLM's where it has them."""
    cli_args.add(
        parser,
        "--limit-mm-per-prompt",
        None,
        help=f"images one prompt may hold, as JSON: '{{\"image\": N}}' (default {DEFAULT_IMAGES_PER_PROMPT})",
    )
    cli_args.add(
        parser, "--max-image-bytes", DEFAULT_MAX_IMAGE_BYTES, type=int, help="largest image file one request may send"
    )
    cli_args.add(
        parser,
        "--allowed-local-media-path",
        None,
        help="a folder whose files image_url parts may name as file:// URLs (default: none may)",
    )


def media_policy(parser: argparse.ArgumentParser, args: argparse.Namespace) -> MediaPolicy:
    count = DEFAULT_IMAGES_PER_PROMPT
    if args.limit_mm_per_prompt:
        try:
            limits = json.loads(args.limit_mm_per_prompt)
            count = limits.get("image", DEFAULT_IMAGES_PER_PROMPT)
            unknown = set(limits) - {"image"}
        except (ValueError, AttributeError):
            parser.error("--limit-mm-per-prompt must be JSON such as '{\"image\": 4}'")
        if unknown:
            parser.error(f"--limit-mm-per-prompt: only images are served, not {sorted(unknown)}")
        if type(count) is not int or count < 0:
            parser.error("--limit-mm-per-prompt: the image count must be an integer >= 0")
    if args.max_image_bytes < 1:
        parser.error("--max-image-bytes must be positive")
    root = None
    if args.allowed_local_media_path:
        root = Path(args.allowed_local_media_path).expanduser().resolve()
        if not root.is_dir():
            parser.error(f"--allowed-local-media-path: {root} is not a folder")
    return MediaPolicy(count, args.max_image_bytes, root)


def media_args_to_argv(args: argparse.Namespace) -> list[str]:
    """`pagemesh up`'s image flags, passed on to its gateway."""
    out = ["--max-image-bytes", str(args.max_image_bytes)]
    if args.limit_mm_per_prompt:
        out += ["--limit-mm-per-prompt", args.limit_mm_per_prompt]
    if args.allowed_local_media_path:
        out += ["--allowed-local-media-path", args.allowed_local_media_path]
    return out
