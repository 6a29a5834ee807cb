"""Flat token files: :class:`TokenFiles` reads them, :class:`TokenWriter` writes them,
:func:`hash_token_files` gives files written without hashes a hashed manifest."""

from loaders.formats.tokens.reader import TokenFiles
from loaders.formats.tokens.writer import TokenWriter, hash_token_files

__all__ = ["TokenFiles", "TokenWriter", "hash_token_files"]
