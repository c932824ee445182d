"""Where an image URL in a request may point, and its fetching (`MediaPolicy.load`).

`data:` URLs always work. `file://` URLs only under `allowed_local_media_path` (vLLM's flag),
resolved with symlinks followed so that no path leaves that directory. `http(s)://` URLs only
with `allow_remote_media` (off by default: a server that fetches what a request names can be
pointed at hosts behind its firewall), each fetch bounded in bytes and seconds. Every refusal
is a ValueError naming the content part.
"""

from __future__ import annotations

import dataclasses
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np

from jengine.vision.decode import MAX_IMAGE_BYTES, decode_data_url, decode_image


@dataclasses.dataclass(frozen=True, kw_only=True)
class MediaPolicy:
    allowed_local_media_path: str | None = None
    allow_remote_media: bool = False
    max_bytes: int = MAX_IMAGE_BYTES
    fetch_timeout: float = 10.0  # seconds for one remote image, connection to last byte

    def load(self, url: str, where: str) -> np.ndarray:
        """The image at `url` as RGB [H, W, 3] uint8."""
        scheme = urllib.parse.urlsplit(url).scheme.lower()
        if scheme == "data":
            return decode_data_url(url, max_bytes=self.max_bytes)
        if scheme == "file":
            return decode_image(self._read_file(url, where), max_bytes=self.max_bytes)
        if scheme in ("http", "https"):
            if not self.allow_remote_media:
                raise ValueError(f"{where}: http(s) image URLs are off on this server (start "
                                 "it with --allow-remote-media); send a data: URL")
            return decode_image(self._fetch(url, where), max_bytes=self.max_bytes)
        raise ValueError(f"{where}: image URL scheme {scheme or '(none)'!r} is not allowed "
                         "(data:, file: under --allowed-local-media-path, http(s): with "
                         "--allow-remote-media)")

    def _read_file(self, url: str, where: str) -> bytes:
        if self.allowed_local_media_path is None:
            raise ValueError(f"{where}: file: image URLs are off on this server (start it with "
                             "--allowed-local-media-path DIR)")
        root = Path(self.allowed_local_media_path).resolve()
        path = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).resolve()
        if not path.is_relative_to(root):
            raise ValueError(f"{where}: {path} is outside --allowed-local-media-path")
        if not path.is_file():
            raise ValueError(f"{where}: no image file at {path}")
        if path.stat().st_size > self.max_bytes:
            raise ValueError(f"{where}: image is over the {self.max_bytes} byte limit")
        return path.read_bytes()

    def _fetch(self, url: str, where: str) -> bytes:
        try:
            with urllib.request.urlopen(url, timeout=self.fetch_timeout) as response:
                data = response.read(self.max_bytes + 1)
        except (urllib.error.URLError, TimeoutError, OSError, ValueError) as e:
            raise ValueError(f"{where}: cannot fetch the image ({e})") from None
        if len(data) > self.max_bytes:
            raise ValueError(f"{where}: image is over the {self.max_bytes} byte limit")
        return data
