"""A multipart/form-data file upload parsed as it arrives, the file straight to disk.

Why: an upload may be 100 MB or more, and a server that buffers whole bodies holds each one
in memory (twice, with the parsed copy) while a tenant's batch file arrives. Here the HTTP
layer hands over each chunk as it reads it; python-multipart (the streaming parser Starlette
and FastAPI use) cuts it into parts; the `file` part's bytes go to a temporary file in the
store's folder, the other fields (`purpose`, `expires_after[...]`: small) are kept in memory.
A file over `max_bytes` stops the upload at once with a 413. No HTTP here.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from llmd.errors import APIError, bad_request

MAX_FIELD_BYTES = 4096  # a form field other than the file (purpose, expires_after[...])


class Upload:
    """Feed it the body's chunks in order, then `finish()`; `fields`, `filename`, `size` and
    `blank` (only whitespace in the file) describe what arrived, the file is at `path`."""

    def __init__(self, content_type: str, path: Path, max_bytes: int, too_big: APIError) -> None:
        ctype, params = parse_options_header(content_type)
        boundary = params.get(b"boundary")
        if ctype != b"multipart/form-data" or not boundary:
            raise bad_request("upload the file as multipart/form-data with fields 'file' and 'purpose'")
        self.path, self.max_bytes, self._too_big = path, max_bytes, too_big
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.size = 0
        self.blank = True
        self._out: IO[bytes] | None = None
        self._name: str | None = None
        self._value = bytearray()
        self._header: list[bytes] = [b"", b""]
        self._disposition = b""
        self._parser = MultipartParser(boundary, {
            "on_part_begin": self._part_begin, "on_header_field": self._header_field,
            "on_header_value": self._header_value, "on_header_end": self._header_end,
            "on_headers_finished": self._headers_done, "on_part_data": self._data, "on_part_end": self._part_end,
        })

    def feed(self, chunk: bytes) -> None:
        try:
            self._parser.write(chunk)
        except MultipartParseError as e:
            raise bad_request(f"malformed multipart/form-data body: {e}") from None

    def finish(self) -> None:
        try:
            self._parser.finalize()
        except MultipartParseError as e:
            raise bad_request(f"malformed multipart/form-data body: {e}") from None
        self.close()
        if self.filename is None:
            raise bad_request("Missing required parameter: 'file'", "file", "missing_required_parameter")

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None

    # -- the parser's callbacks ------------------------------------------------------------
    def _part_begin(self) -> None:
        self._name, self._disposition = None, b""
        self._value.clear()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header[0] += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._header[1] += data[start:end]

    def _header_end(self) -> None:
        if self._header[0].lower() == b"content-disposition":
            self._disposition = self._header[1]
        self._header = [b"", b""]

    def _headers_done(self) -> None:
        _, params = parse_options_header(self._disposition)
        self._name = params.get(b"name", b"").decode("utf-8", "replace")
        if self._name == "file":
            if self.filename is not None:
                raise bad_request("only one 'file' per upload", "file")
            self.filename = params.get(b"filename", b"upload.jsonl").decode("utf-8", "replace") or "upload.jsonl"
            self._out = self.path.open("wb")

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self._name != "file":
            self._value += data[start:end]
            if len(self._value) > MAX_FIELD_BYTES:
                raise bad_request(f"form field {self._name!r} is too long", self._name)
            return
        assert self._out is not None
        self.size += end - start
        if self.size > self.max_bytes:
            raise self._too_big
        piece = data[start:end]
        if self.blank and piece.strip():
            self.blank = False
        self._out.write(piece)

    def _part_end(self) -> None:
        if self._name == "file":
            self.close()
        elif self._name:
            self.fields[self._name] = self._value.decode("utf-8", "replace")
