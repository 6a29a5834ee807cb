"""MosaicML Streaming MDS datasets: :class:`MDS` reads them, :class:`MDSWriter` writes them."""

from loaders.formats.mds.reader import MDS
from loaders.formats.mds.writer import MDSWriter

__all__ = ["MDS", "MDSWriter"]
