"""Writers of the formats ``loaders`` reads: token files, MDS and WebDataset tars, to a local
path or any store URI (one or several replicas), index last. See docs/loaders.md."""

from loaders.write.mds import MDSWriter
from loaders.write.tokens import TokenWriter
from loaders.write.wds import WebDatasetWriter

__all__ = ["MDSWriter", "TokenWriter", "WebDatasetWriter"]
