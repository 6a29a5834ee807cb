"""Flat token files: :class:`TokenFiles` reads them, :class:`TokenWriter` writes them."""

from loaders.formats.tokens.reader import TokenFiles
from loaders.formats.tokens.writer import TokenWriter

__all__ = ["TokenFiles", "TokenWriter"]
