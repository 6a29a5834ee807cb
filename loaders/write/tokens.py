"""Token files as ``TokenFiles`` reads them: flat uint16/uint32 arrays of token ids, optionally
behind llm.c's 1024-byte header (256 int32: magic, version, token count)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from loaders.tokens import LLMC_HEADER_BYTES, llmc_header
from loaders.write._sink import DatasetSink, ShardWriter, Target, manifest_bytes


class TokenWriter(ShardWriter):
    """Writes token ids into files of at most ``file_tokens`` tokens (``{prefix}.00000.bin``,
    ...) and, last, ``manifest`` listing them; read them back with
    ``TokenFiles(dtype=..., manifest=..., header=writer.header)``.

    Make ``file_tokens`` a multiple of the reader's ``sample_tokens``: the reader drops each
    file's trailing partial sample. ``header="llmc"`` writes llm.c's header, None none (as
    nanoGPT's ``train.bin`` and Megatron's ``.bin``)."""

    HEADER_BYTES = {None: 0, "llmc": LLMC_HEADER_BYTES}
    """Bytes each file's header takes, by ``header`` (the reader's ``header_bytes``)."""

    def __init__(
        self,
        uri: Target | Sequence[Target],
        *,
        dtype: str = "uint16",
        header: str | None = None,
        file_tokens: int = 2**26,
        prefix: str = "tokens",
        manifest: str = "manifest.txt",
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if dtype not in ("uint16", "uint32"):
            raise ValueError(f"TokenWriter dtype must be uint16 or uint32, got {dtype!r}")
        if header not in self.HEADER_BYTES:
            raise ValueError(f"TokenWriter header must be None or 'llmc', got {header!r}")
        if file_tokens < 1:
            raise ValueError(f"TokenWriter file_tokens must be >= 1, got {file_tokens}")
        self.dtype, self.header, self.file_tokens, self.prefix = dtype, header, file_tokens, prefix
        self.header_bytes = self.HEADER_BYTES[header]
        self.sink = DatasetSink(uri, index=manifest, storage_options=storage_options)
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        self.num_tokens = 0

    def write(self, tokens: Any) -> None:
        """Append token ids (any 1-D integer array-like); files are written as they fill."""
        self.sink.check_open()
        arr = np.asarray(tokens)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError(
                f"TokenWriter.write takes a 1-D array of integer token ids, got shape "
                f"{arr.shape} of {arr.dtype}"
            )
        limit = np.iinfo(self.dtype).max
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) > limit):
            raise ValueError(
                f"token ids must be within [0, {limit}] for {self.dtype}, got "
                f"[{int(arr.min())}, {int(arr.max())}]"
            )
        arr = arr.astype(f"<{np.dtype(self.dtype).str[1:]}")  # a copy: the caller may reuse arr
        while arr.size:
            take = min(arr.size, self.file_tokens - self._pending_tokens)
            self._pending.append(arr[:take])
            self._pending_tokens += take
            arr = arr[take:]
            if self._pending_tokens == self.file_tokens:
                self._flush()

    def _flush(self) -> None:
        if not self._pending_tokens:
            return
        key = f"{self.prefix}.{len(self.shards):05d}.bin"
        parts: list = [np.ascontiguousarray(p).data for p in self._pending]
        if self.header:
            parts.insert(0, llmc_header(self.dtype, self._pending_tokens))
        self.sink.put(key, parts)
        self.num_tokens += self._pending_tokens
        self._pending, self._pending_tokens = [], 0

    def _index_bytes(self) -> bytes:
        return manifest_bytes(self.shards)
