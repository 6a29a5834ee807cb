"""WebDataset tar shards: :class:`WebDataset` reads them, :class:`WebDatasetWriter` writes them."""

from loaders.formats.wds.reader import WebDataset
from loaders.formats.wds.writer import WebDatasetWriter

__all__ = ["WebDataset", "WebDatasetWriter"]
