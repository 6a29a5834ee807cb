"""The dataset formats, each one's reader and writer in its own folder (``mds``, ``wds``,
``tokens``), and what they share: the reader's contract with the dataset (``layout``), the shard
list of formats without an index of their own (``manifest``), the writers' write-once replica
output (``_writing``) and shard decompression and hashes (``_codecs``)."""
