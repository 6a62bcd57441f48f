"""megatron-core's objects as the plugin reads them: where the DDP chunks are (``chunks``), the
buffers, buckets, bucket groups and main-param shards (``layout``), and bucket offsets (``buckets``).
A megatron-core release that renames one of these attributes is a change here only.
"""
